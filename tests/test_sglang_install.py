"""The SGLang venv's own check (scripts/install_sglang_cpu.sh) sees the `mori` plugin once, also
when run from a checkout installed with `pip install -e .`, whose mori.egg-info lists the entry
point a second time."""

from __future__ import annotations

import re
import subprocess

from tests.sglang.server import INSTALLER, PYTHON, REAL_ENGINE

pytestmark = REAL_ENGINE


def test_install_check_lists_the_plugin_once_from_an_editable_checkout(tmp_path):
    script = INSTALLER.read_text()
    flags, check = re.search(
        r'"\$VENV/bin/python"( -P)? - <<\'EOF\'\n(.*?)\nEOF\n', script, re.S
    ).groups()
    egg = tmp_path / "mori.egg-info"  # what `pip install -e .` leaves in the checkout
    egg.mkdir()
    (egg / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: mori\nVersion: 0.1.0\n")
    (egg / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\nmori = engine_patches.plugin:register\n"
    )
    argv = [str(PYTHON), *(flags or "").split(), "-"]
    done = subprocess.run(
        argv, input=check, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "plugins ['mori']" in done.stdout, done.stdout
