"""Which code made a result: the commit recorded in run.json / locality.json, in a checkout and in a tree
unpacked from ``git archive`` (the GPU host's copy)."""

import shutil
import subprocess
import tarfile

import pytest

from sut.constants import REPO
from sut.record.provenance import harness_commit

SHA = "0123456789abcdef0123456789abcdef01234567"


def test_an_archived_tree_names_the_commit_git_archive_wrote(tmp_path):
    (tmp_path / "COMMIT").write_text(SHA + "\n")
    assert harness_commit(tmp_path, tmp_path / "COMMIT") == {"harness_commit": SHA,
                                                              "harness_uncommitted_changes": None}


@pytest.mark.parametrize("text", ["$Format:%H$\n", "not a commit\n", None])
def test_a_placeholder_or_a_missing_file_is_no_commit(tmp_path, text):
    if text is not None:
        (tmp_path / "COMMIT").write_text(text)
    assert harness_commit(tmp_path, tmp_path / "COMMIT")["harness_commit"] is None


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs a git checkout")
def test_a_checkout_answers_git_and_an_archive_of_it_carries_the_same_commit(tmp_path):
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert harness_commit()["harness_commit"] == head
    tar = tmp_path / "src.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "HEAD", "-o", str(tar)], check=True)
    with tarfile.open(tar) as t:
        t.extract("sut/record/COMMIT", tmp_path / "x", filter="data")
    unpacked = tmp_path / "x"
    assert harness_commit(unpacked, unpacked / "sut/record/COMMIT") == {"harness_commit": head,
                                                                        "harness_uncommitted_changes": None}
