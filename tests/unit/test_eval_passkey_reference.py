"""The tape / longlora passkey protocols against a re-statement of the reference scripts, written out below.

LongLoRA's passkey_retrivial.py and the TAPE repository's eval_retrieval.py (identical apart from defaults):
    generate_prompt_landmark(n_garbage, seed): numpy.random.seed(seed); n_prefix = randint(0, n_garbage);
    garbage_inf = " ".join([garbage] * 5000); prefix = garbage_inf[:n_prefix]; suffix = garbage_inf[:n_garbage -
    n_prefix]; pass_key = randint(1, 50000); prompt = "\\n".join([task, prefix, info line, suffix, question]).
    The prompt is tokenized whole by Llama's tokenizer (BOS added); the answer is str(pass_key) tokenized with
    its BOS dropped. Length point i uses n_garbage = int(3.75 * (i + 1) * interval // 1024 * 1024) for
    i in range(max_tokens // interval); trials use seeds 0 .. num_tests - 1; greedy generate(max_new_tokens =
    len(answer), use_cache=False); correct iff the last len(answer) tokens equal the answer tokens; a length is
    reported at total_tokens // num_tests.
"""

import json

import numpy as np
import pytest
import torch
from test_hf_runs import passkey_run_and_export

from tapetrain.cli import main
from tapetrain.data.tokenizer import Tokenizer
from tapetrain.eval import passkey_reference as ref
from tapetrain.eval.models import load_eval_model
from tapetrain.eval.passkey import run_eval_passkey

TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will quiz "
        "you about the important information there.")
GARBAGE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION = "What is the pass key? The pass key is"


def restated_prompt(n_garbage: int, seed: int) -> tuple[str, str]:
    state = np.random.get_state()
    np.random.seed(seed)
    n_prefix = np.random.randint(0, n_garbage)
    n_suffix = n_garbage - n_prefix
    garbage_inf = " ".join([GARBAGE] * 5000)
    pass_key = np.random.randint(1, 50000)
    info = f"The pass key is {pass_key}. Remember it. {pass_key} is the pass key."
    np.random.set_state(state)
    return "\n".join([TASK, garbage_inf[:n_prefix], info, garbage_inf[:n_suffix], QUESTION]), str(pass_key)


def restated_schedule(max_tokens: int, interval: int) -> list[int]:
    return [int(3.75 * (i + 1) * interval // 1024 * 1024) for i in range(max_tokens // interval)]


def test_prompts_and_schedule_are_the_scripts():
    assert ref.garbage_schedule(8192) == restated_schedule(8192, 1000)
    assert ref.garbage_schedule(8192) == [3072, 7168, 10240, 14336, 18432, 21504, 25600, 29696]
    assert ref.garbage_schedule(32000) == restated_schedule(32000, 1000) and len(ref.garbage_schedule(32000)) == 32
    for n_garbage in (3072, 29696, 1024):
        for seed in range(20):
            trial = ref.reference_trial(n_garbage, seed)
            assert (trial.text, trial.answer) == restated_prompt(n_garbage, seed)
            assert 0 <= trial.prefix_chars < n_garbage and 1 <= trial.pass_key < 50000
    # The differences the issue listed against our own protocol are all there.
    text = ref.reference_trial(3072, 0).text
    assert "memorize them" in text and text.count("\n") == 4
    with pytest.raises(ValueError, match="too small"):
        ref.garbage_schedule(1000, 200)
    with pytest.raises(ValueError, match="no length point"):
        ref.garbage_schedule(500, 1000)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return passkey_run_and_export(tmp_path_factory.mktemp("passkey_ref"))


def test_token_ids_match_transformers_tokenizer(setup):
    from transformers import AutoTokenizer

    _, hf, tokenizer = setup
    hf_tok = AutoTokenizer.from_pretrained(hf)
    tok = Tokenizer(tokenizer)
    for seed in range(5):
        text, answer = restated_prompt(1024, seed)
        ids, answer_ids = ref.reference_ids(tok, ref.reference_trial(1024, seed))
        assert ids == [tok.bos_id] + hf_tok(text, add_special_tokens=False).input_ids
        assert answer_ids == hf_tok(answer, add_special_tokens=False).input_ids
        assert ids[0] == 1 and "\n" in tok.decode(ids)


def test_reference_defaults():
    assert (ref.REFERENCES["tape"].trials, ref.REFERENCES["tape"].max_tokens) == (20, 8192)  # TAPE README command
    assert (ref.REFERENCES["longlora"].trials, ref.REFERENCES["longlora"].max_tokens) == (10, 32000)  # argparse


def test_reference_protocol_end_to_end(setup, tmp_path):
    run, hf, tokenizer = setup
    protocol = "tape"  # longlora runs the same code with other defaults
    assert main(["eval", "passkey", str(hf), "--protocol", protocol, "--max-tokens", "300",
                 "--interval", "300", "--trials", "2", "--out", str(tmp_path / "r.json"),
                 "--plot", str(tmp_path / "r.png")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["protocol"] == protocol and report["trials"] == 2
    assert (tmp_path / "r.png").stat().st_size > 1000
    tok = Tokenizer(tokenizer)
    model = load_eval_model(str(run))  # the run directory: decode independently of the export under test
    assert [r["n_garbage"] for r in report["results"]] == restated_schedule(300, 300) == [1024]
    for result in report["results"]:
        lengths = []
        for seed, record in enumerate(result["records"]):
            text, answer = restated_prompt(result["n_garbage"], seed)
            ids = [tok.bos_id] + tok.encode(text)
            answer_ids = tok.encode(answer)
            with torch.no_grad():  # greedy, no cache, exactly len(answer) new tokens
                out = model.module.generate(torch.tensor([ids]), len(answer_ids), use_cache=False)
            expected = out[0, len(ids):].tolist()
            assert record["seed"] == seed and record["pass_key"] == int(answer)
            assert record["answer_ids"] == answer_ids and record["generated_ids"] == expected
            assert record["correct"] == (expected == answer_ids)
            lengths.append(len(ids))
        assert result["length"] == sum(lengths) // 2 and result["accuracy"] == result["correct"] / 2


def test_early_eos_is_a_miss_not_suppressed(setup):
    _, hf, tokenizer = setup
    model = load_eval_model(str(hf))
    ids, _ = ref.reference_ids(Tokenizer(tokenizer), ref.reference_trial(1024, 0))
    first = int(model.generate_greedy(torch.tensor([ids]), 1)[0])
    model.module.generation_config.eos_token_id = first  # the model's very first greedy token now ends the text
    assert len(model.generate_greedy(torch.tensor([ids]), 4, use_cache=False, suppress_eos=False)) == 1
    assert len(model.generate_greedy(torch.tensor([ids]), 4)) == 4  # our protocol decodes a full answer


def test_protocol_knobs_are_checked(setup):
    _, hf, _ = setup
    with pytest.raises(ValueError, match="--lengths applies to --protocol tapetrain"):
        run_eval_passkey(str(hf), [128], protocol="tape")
    with pytest.raises(ValueError, match="--max-tokens applies to the reference protocols"):
        run_eval_passkey(str(hf), protocol="tapetrain", max_tokens=2000)
    with pytest.raises(ValueError, match="--seed applies to --protocol tapetrain"):
        run_eval_passkey(str(hf), protocol="longlora", seed=3)
