"""The launcher's own process: what it reads without importing torch (no ranks started here)."""

from tests.conftest import ROOT

SUITE_CACHE = ROOT / "runs" / "cache"  # model.cache_dir's default: the suite's `megarl train` runs share it


def test_the_launchers_vocabulary_size_is_transformers_len_of_the_tokenizer(tmp_path):
    """model_source reads a random model's vocabulary size without transformers (which imports torch):
    it must equal len(AutoTokenizer), the added tokens included."""
    from transformers import AutoTokenizer

    from megarl.model_source import _smollm2_tokenizer, tokenizer_vocab_size

    base = _smollm2_tokenizer(SUITE_CACHE)
    extended = AutoTokenizer.from_pretrained(base)
    extended.add_tokens(["<tool_call_x>", "<tool_result_x>"])
    extended.add_special_tokens({"additional_special_tokens": ["<|megarl_test|>"]})
    extended.save_pretrained(tmp_path / "extended")
    for path in (base, tmp_path / "extended"):
        assert tokenizer_vocab_size(path) == len(AutoTokenizer.from_pretrained(path))
    assert tokenizer_vocab_size(tmp_path / "extended") == tokenizer_vocab_size(base) + 3
