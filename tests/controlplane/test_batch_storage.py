"""controlplane/batches/storage.py: a batch's work file cut off mid-line (the control plane killed while it
wrote a result) loses that line only, and appending goes on from a line's start."""

from pathlib import Path

from controlplane.batches.storage import finished_lines


def test_a_half_written_last_line_is_cut_off_and_the_whole_ones_kept(tmp_path: Path) -> None:
    work = tmp_path / "output.jsonl"
    work.write_bytes(b'{"custom_id":"a"}\n{"custom_id":"b"}\n{"custom_id":"c","respo')
    assert finished_lines(work) == [b'{"custom_id":"a"}', b'{"custom_id":"b"}']
    with work.open("ab") as file:
        file.write(b'{"custom_id":"c"}\n')
    assert finished_lines(work)[-1] == b'{"custom_id":"c"}'
    assert finished_lines(tmp_path / "none-yet.jsonl") == []
