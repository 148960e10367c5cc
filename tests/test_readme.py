"""The README's example runs as written and shows compression on the wire."""

import pathlib
import re


def test_readme_example_runs_and_compresses(capsys):
  readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
  example = re.search(r"## Example\n\n```python\n(.*?)```", readme, re.S).group(1)
  namespace = {}
  exec(compile(example, "README.md", "exec"), namespace)  # pylint: disable=exec-used
  report = namespace["report"]
  n, d = 8, 256 * 16 + 16
  dense = 2 * (n - 1) / n * 4 * d
  assert report.total * 10 < dense
  assert "bytes per device per step" in capsys.readouterr().out
