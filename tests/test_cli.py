"""The `opt-serving` command line (`python -m opt_serving`), run as a user would, in a subprocess."""
import os
import subprocess
import sys
from pathlib import Path

from opt_serving.cli import COMMANDS

REPO = Path(__file__).resolve().parents[1]


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "opt_serving", *args], cwd=REPO, env=env,
                          capture_output=True, text=True)


def test_help_lists_every_subcommand():
    res = cli("--help")
    assert res.returncode == 0, res.stderr
    for name in ("convert", "plan", "serve", "batch", "tiny"):
        assert name in COMMANDS
        assert f"    {name}" in res.stdout, res.stdout  # the subcommand table, not just any mention


def test_unknown_subcommand_fails_with_a_message():
    res = cli("frobnicate")
    assert res.returncode != 0
    assert "frobnicate" in res.stderr and "invalid choice" in res.stderr


def test_tiny_prints_the_model_folder(tmp_path):
    env = dict(os.environ, OPT_SERVING_CACHE=str(tmp_path))
    first = cli("tiny", env=env)
    assert first.returncode == 0, first.stderr
    folder = Path(first.stdout.strip())
    assert folder == tmp_path / "opt-tiny-np"
    assert (folder / "config.json").is_file() and (folder / "vocab.json").is_file()
    inode = folder.stat().st_ino
    forced = cli("tiny", "--force", env=env)
    assert forced.returncode == 0 and Path(forced.stdout.strip()) == folder
    assert folder.stat().st_ino != inode  # --force rebuilt it


def test_tiny_help_shows_its_options():
    res = cli("tiny", "--help")
    assert res.returncode == 0 and "--force" in res.stdout and "--cache-dir" in res.stdout
