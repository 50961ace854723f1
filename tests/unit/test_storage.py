"""The shared-storage check's pure parts: the marker's name and the error message."""

from __future__ import annotations

from meshrun.runtime.storage import Sighting, job_id, marker_name, unshared_message


def test_every_rank_seeing_the_marker_is_no_error() -> None:
    seen = [Sighting(r, "a", "/shared/run", True) for r in range(4)]
    assert unshared_message(seen, ".meshrun-shared-x") is None


def test_the_message_names_each_host_and_directory_that_misses_the_marker() -> None:
    seen = [
        Sighting(0, "node-a", "/shared/run", True),
        Sighting(1, "node-a", "/shared/run", True),
        Sighting(2, "node-b", "/local/run", False),
        Sighting(3, "node-b", "/local/run", False),
    ]
    text = unshared_message(seen, ".meshrun-shared-7-abc")
    assert text is not None
    assert text.startswith("job.run_dir is not shared by all ranks: rank 0 on node-a wrote ")
    assert ".meshrun-shared-7-abc in /shared/run" in text
    assert "2 of 4 ranks do not see it (ranks 2, 3 on node-b in /local/run)" in text
    assert "--job.run_dir=/shared/runs/NAME" in text


def test_marker_names_are_unique_per_start_and_safe_as_file_names() -> None:
    job = job_id({"TORCHELASTIC_RUN_ID": "my job/1"})
    assert job == "my_job_1"
    assert marker_name(job, "ab12") == ".meshrun-shared-my_job_1-ab12"
    assert job_id({"SLURM_JOB_ID": "4242"}) == "4242"
    assert job_id({}) == "job"
