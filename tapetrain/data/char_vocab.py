"""A fixed character vocabulary saved as a sentencepiece model, so task data with its own small alphabet
(arithmetic) decodes through the same `Tokenizer` as everything else: run directories, `tapetrain export hf` and the
eval tools find it like any other tokenizer.

Ids: 0 <unk>, 1 <s> (BOS), 2 </s> (EOS), 3 <pad>, then one id per character in the order given. The model is a
sentencepiece CHAR model with identity normalisation and no dummy prefix, so encode("12+3=") is one id per
character and decode(encode(text)) == text for any text over the alphabet.
"""

from __future__ import annotations

from tapetrain import atomic_io
from tapetrain.data.errors import DataError

SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3


def char_vocab_model(alphabet: str) -> bytes:
    """The serialized sentencepiece ModelProto of SPECIALS + the characters of `alphabet` (in order)."""
    if len(set(alphabet)) != len(alphabet) or not alphabet:
        raise DataError(f"alphabet {alphabet!r} must be non-empty with every character once")
    if any(c.isspace() for c in alphabet):
        raise DataError(f"alphabet {alphabet!r} holds whitespace; sentencepiece would rewrite it")
    from sentencepiece import sentencepiece_model_pb2 as pb

    model = pb.ModelProto()
    model.trainer_spec.model_type = pb.TrainerSpec.CHAR
    model.trainer_spec.vocab_size = len(SPECIALS) + len(alphabet)
    model.trainer_spec.unk_id, model.trainer_spec.bos_id = UNK_ID, BOS_ID
    model.trainer_spec.eos_id, model.trainer_spec.pad_id = EOS_ID, PAD_ID
    model.normalizer_spec.name = "identity"
    model.normalizer_spec.add_dummy_prefix = False
    model.normalizer_spec.remove_extra_whitespaces = False
    model.normalizer_spec.escape_whitespaces = False
    kinds = pb.ModelProto.SentencePiece
    for i, piece in enumerate(SPECIALS + tuple(alphabet)):
        entry = model.pieces.add()
        entry.piece, entry.score = piece, 0.0
        entry.type = kinds.UNKNOWN if i == UNK_ID else kinds.CONTROL if i < len(SPECIALS) else kinds.NORMAL
    return model.SerializeToString()


def write_char_vocab(alphabet: str, path: str) -> str:
    """Write the character vocabulary of `alphabet` to `path` (atomic_io); return the path."""
    atomic_io.write_bytes(path, char_vocab_model(alphabet))
    return path
