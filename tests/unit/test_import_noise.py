"""Importing torchao (transformers does when it is installed) logs a warning per CUDA extension it cannot load and
torch's pytree deprecation; tapetrain drops exactly those records and lets every other one through."""

import logging

import tapetrain  # noqa: F401 - installs the filters


def test_torchaos_extension_warnings_are_dropped_and_others_pass(caplog):
    caplog.set_level(logging.WARNING)
    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    torchao.warning("Failed to load /v/torchao/_C_mxfp8.so: Could not load this library: /v/torchao/_C_mxfp8.so")
    pytree.warning("%s is an Enum subclass and is now natively supported ... Calling register_constant() on Enum "
                   "subclasses is deprecated", "<enum 'KernelPreference'>")
    torchao.warning("Failed to load the model config")  # another torchao warning: kept
    pytree.warning("something else about pytrees")
    assert [r.getMessage() for r in caplog.records] == ["Failed to load the model config",
                                                        "something else about pytrees"]
