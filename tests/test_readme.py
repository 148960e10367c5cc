"""Every Python block of the README runs as written, in order, in one fresh interpreter (as a
reader pastes them into one session), and the first example shows compression on the wire."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[1]


def test_readme_python_blocks_run_as_written_and_compress():
  readme = (ROOT / "README.md").read_text()
  blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
  assert len(blocks) >= 5
  session = "\n".join(blocks)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the README sets the count
  done = subprocess.run([sys.executable, "-c", session], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  out = done.stdout
  sent = float(re.search(r"([\d,]+) bytes per device per step; dense: ([\d,]+)", out).group(1)
               .replace(",", ""))
  assert 0 < sent * 10 < 2 * 7 / 8 * 4 * (256 * 16 + 16), out
  assert re.search(r"TASC: [\d,]+ bytes per device per step", out), out
  assert re.search(r"halves: [\d,]+ bytes per step", out) and "dgc" in out, out
  (loss_1, bytes_1), (loss_8, bytes_8) = re.findall(
      r"8 (?:workers on 1 device|devices, 1 worker each): loss ([\d.]+), ([\d,]+) bytes", out)
  # The same bytes; the same loss but for the order of the sum over workers.
  assert bytes_1 == bytes_8 and abs(float(loss_1) - float(loss_8)) < 1e-6 * float(loss_8), out
