"""Context-parallel attention (all-gather and Ulysses) and document masking across 2 ranks.

One plan entry in the shared 2-rank launch (attention_jobs.py, attention_paths_run.py) runs every
check; these tests read its result.
Numerics are fp32 on gloo and must match one process to 1e-5 relative: Ulysses forward and
backward against full causal attention (MHA and GQA); a tiny Llama with document masking at cp 2
over both paths against one process (loss and every gradient); and whole training jobs
(cp 2 Ulysses with full checkpointing, pipeline 2) whose first logged loss must equal one process's.
"""

from __future__ import annotations

import pytest

from .attention_jobs import TRAIN_JOBS

pytestmark = pytest.mark.torchrun

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def result(attention_paths) -> dict:
    """What the shared 2-rank launch found (attention_jobs.py, conftest.py)."""
    return attention_paths


@pytest.mark.parametrize("case", ["4/4", "4/2", "8/2", "6/2"])
def test_ulysses_attention_matches_full_causal_attention_forward_and_backward(result, case):
    errors = result["ulysses"][case]
    assert max(errors.values()) <= TOLERANCE, errors


@pytest.mark.parametrize("path", ["allgather", "ulysses"])
def test_document_masking_at_cp2_matches_one_process_loss_and_gradients(result, path):
    errors = result["documents"][path]
    assert len(errors) > 10  # the loss and every parameter's gradient
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE, f"{worst}: {errors[worst]:.2e}"


@pytest.mark.parametrize("job", list(TRAIN_JOBS))
def test_training_with_document_masking_starts_at_the_one_process_loss(result, job):
    found = result["train"][job]
    first, reference = found["losses"][0], found["reference_loss"]
    assert abs(first - reference) <= TOLERANCE * reference, (first, reference)
    # The mask matters at this tolerance: the same tokens unmasked start elsewhere.
    assert abs(found["unmasked_loss"] - reference) > 3 * TOLERANCE * reference
    assert len(found["losses"]) == 2
