"""Semantic points on every decoder architecture: right, or refused loudly, never silently wrong (issue 33).

One tiny model per architecture (``tests/arch_matrix.py``: 3 layers, O(1)-scale weights, sliding windows,
soft-caps, NoPE layers, partial rotary, q/k norms, parallel residuals, MQA switched on where the config
allows), every point at every layer compared with plain torch hooks on one Hugging Face forward and with
Hugging Face's own eager attention weights; an in-place edit of ``resid_post`` and of ``attn.z`` compared
with a hand-written hook doing the same edit. The whole matrix is computed once for the module (about
10-30 s here) and is also what ``docs/architectures.md`` shows: the last test regenerates that page and
checks it equals the committed file.
"""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "scripts"))
import arch_matrix as am                          # noqa: E402
from architectures_table import DOC, render       # noqa: E402

REQUIRED = ("gemma gemma2 gemma3_text qwen2 qwen3 qwen2_moe qwen3_moe llama llama4_text mistral mixtral phi phi3 "
            "gpt_neox gptj opt falcon olmo olmo2 deepseek_v2 deepseek_v3 bloom gpt_bigcode starcoder2 cohere "
            "granite smollm3 glm exaone4 stablelm mpt gpt2").split()


@pytest.fixture(scope="module")
def matrix():
    return am.check_all()


def _cells(matrix, statuses):
    return [(name, col, cell["note"]) for name, cells in matrix.items() if "build" not in cells
            for col, cell in cells.items() if cell["status"] in statuses]


def test_every_required_architecture_is_built_and_at_least_40(matrix):
    built = [n for n, c in matrix.items() if "build" not in c]
    assert not [n for n in REQUIRED if n not in built], {n: matrix[n].get("build") for n in REQUIRED}
    assert len(built) >= 40, len(built)


def test_no_cell_is_silently_wrong_or_obscure(matrix):
    counts = {s: len(_cells(matrix, {s})) for s in ("ok", "refused", "absent", "wrong", "error", "unchecked")}
    print(f"\narchitecture x point cells: {counts}")
    assert _cells(matrix, {"wrong", "error", "unchecked"}) == []


def test_at_least_90_percent_of_existing_tensors_give_a_value(matrix):
    points = [c for c in am.LAYER_POINTS + am.MODEL_POINTS]
    ok = sum(1 for cells in matrix.values() if "build" not in cells for c in points if cells[c]["status"] == "ok")
    refused = sum(1 for cells in matrix.values() if "build" not in cells for c in points
                  if cells[c]["status"] == "refused")
    print(f"\n{ok} right, {refused} refused although the tensor exists: {100 * ok / (ok + refused):.1f}%")
    assert ok / (ok + refused) >= 0.9


def test_refusals_say_which_architecture_and_why(matrix):
    for name, col, note in _cells(matrix, {"refused", "absent"}):
        assert (f"'{name}'" in note or "is a module" in note or "no 'router'" in note
                or "no 'routed'" in note or name in note), (name, col, note)
        assert len(note) > 60, (name, col, note)       # a reason, not just a name


def test_edits_of_resid_post_and_z_equal_a_hand_written_hook_everywhere(matrix):
    for name, cells in matrix.items():
        if "build" in cells:
            continue
        assert cells["edit resid_post"]["status"] == "ok", (name, cells["edit resid_post"])
        z = cells["edit attn.z"]
        # the z edit is made wherever attn.z is given (it is refused, with its reason, on differential attention)
        assert z["status"] == "ok" or (z["status"] == "skipped" and cells["attn.z"]["status"] == "refused"), (name, z)


def test_docs_architectures_md_is_what_the_code_gives(matrix):
    text = render(matrix)
    assert DOC.read_text() == text, ("docs/architectures.md is out of date: run "
                                     "`python scripts/architectures_table.py` and commit it")
