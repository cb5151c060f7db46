"""The kept ids of a tenant's prompts (serve/jobs/prompt_ids.py): per tokenizer, per owner, bounded."""

from asyncinterp.serve.jobs import prompt_ids


class Tokenizer:
    pass


class Unreferenceable:
    __slots__ = ()


def test_each_tokenizer_keeps_its_own_prompts_and_each_owner_finds_only_its_own():
    a, b = Tokenizer(), Tokenizer()
    kept = prompt_ids.of(a)
    assert prompt_ids.of(a) is kept and prompt_ids.of(b) is not kept
    kept.put("alice", "the prompt", [1, 2, 3])
    assert kept.get("alice", "the prompt") == (1, 2, 3)
    assert kept.get("bob", "the prompt") is None            # another tenant never finds it
    assert prompt_ids.of(b).get("alice", "the prompt") is None   # nor another tokenizer


def test_kept_prompts_are_bounded_and_a_tokenizer_without_weak_references_keeps_none():
    kept = prompt_ids.PromptIds(size=2)
    for i in range(3):
        kept.put("", f"prompt {i}", [i])
    assert len(kept) == 2 and kept.get("", "prompt 0") is None and kept.get("", "prompt 2") == (2,)
    by_chars = prompt_ids.PromptIds(max_chars=30)
    by_chars.put("", "x" * 20, [1])
    by_chars.put("", "y" * 20, [2])
    assert by_chars.get("", "x" * 20) is None and by_chars.get("", "y" * 20) == (2,)
    assert prompt_ids.of(Unreferenceable()) is None
