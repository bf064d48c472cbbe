"""Credential masking in config dumps and log text (relax/utils/redact.py)."""

from relax.utils.redact import MASK, redact_text, redact_tree, secret_key, secret_values


def test_secret_keys_are_words_not_substrings():
    for key in ("token", "hf_token", "apiKey", "api_key", "Authorization", "password", "accessToken"):
        assert secret_key(key), key
    for key in ("max_new_tokens", "video_max_tokens", "tokenizer_path", "max_total_tokens", "keyword"):
        assert not secret_key(key), key


def test_redact_tree_masks_credential_strings_and_keeps_counts():
    dump = {
        "rollout": {"max_new_tokens": 64, "agent": {"max_total_tokens": 512}},
        "reward": {"remote": {"headers": {"Authorization": "Bearer abcdef123456"}, "api_key": "k-1234"}},
        "tokenizer": {"pad_token_id": 0},
        "notify": {"urls": ["mailto://me:hunter22@example.org"]},
    }
    out = redact_tree(dump)
    assert out["rollout"] == {"max_new_tokens": 64, "agent": {"max_total_tokens": 512}}
    assert out["tokenizer"] == {"pad_token_id": 0}
    assert out["reward"]["remote"] == {"headers": {"Authorization": MASK}, "api_key": MASK}
    assert out["notify"]["urls"] == [f"mailto://me:{MASK}@example.org"]
    assert sorted(secret_values(dump)) == ["Bearer abcdef123456", "k-1234"]


def test_redact_text_masks_credential_shapes():
    text = "GET https://rm.example/score?token=s3cr3t&x=1 with Authorization: Bearer abcdefghij"
    assert (
        redact_text(text)
        == f"GET https://rm.example/score?token={MASK}&x=1 with Authorization: Bearer {MASK}"
    )
