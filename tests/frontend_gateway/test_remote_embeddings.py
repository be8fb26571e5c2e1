"""How the ingress cuts a request's texts into batches for the embedding workers."""

from frontend_gateway.models.remote_embeddings import BATCH_BYTES, BATCH_TEXTS, batches


def test_texts_are_cut_by_count_keeping_their_order_and_indexes() -> None:
    texts = [f"text {index}" for index in range(BATCH_TEXTS * 2 + 1)]
    cut = batches(texts)
    whole = BATCH_TEXTS
    assert [(start, len(batch)) for start, batch in cut] == [(0, whole), (whole, whole), (2 * whole, 1)]
    assert [text for _, batch in cut for text in batch] == texts


def test_texts_are_cut_by_size_and_a_huge_text_goes_alone() -> None:
    third = "x" * (BATCH_BYTES // 3)
    huge = "é" * BATCH_BYTES  # two bytes a character: over the limit on its own
    cut = batches([third, third, third, third, huge, "tail"])
    assert [(start, len(batch)) for start, batch in cut] == [(0, 3), (3, 1), (4, 1), (5, 1)]


def test_no_texts_no_batches() -> None:
    assert batches([]) == []
