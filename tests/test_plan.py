"""``python -m experiments.plan``: the three setups of the README (from the published DiLoCo law
alone, and as the README prints them from the committed S1-LM fits), plans from S1-LM's fits
(intervals, provisional laws, the preference for a law near its fitted sizes), and bad input
refused in one line naming the flag."""

import json
import pathlib
import re

import numpy as np
import pytest

from compressors import equal_bytes
from compressors import step_time
from compressors.network import topology as topo
from experiments import cli
from experiments import plan

SETUPS = {  # the README's three
    "1.3B": ["--params=1.3e9", "--tokens=26e9", "--workers=8", "--bandwidth_gbit=1"],
    "cpu tier": ["--params=235264", "--tokens=4096000", "--workers=8", "--bandwidth_gbit=10",
                 "--device=cpu"],
    "100M": ["--params=1e8", "--tokens=2e9", "--workers=64", "--bandwidth_gbit=100"],
}


def run(argv, tmp_path, capsys) -> list[str]:
  # No S1-LM fits: the published law (the committed tree has none until the grid runs).
  plan.main([*argv, f"--fits={tmp_path / 'none.csv'}"])
  return capsys.readouterr().out.splitlines()


def line(lines, start):
  return next(text for text in lines if text.strip().startswith(start))


def test_a_1_3b_model_on_a_slow_link_gets_diloco_by_the_published_law(tmp_path, capsys):
  lines = run(SETUPS["1.3B"], tmp_path, capsys)
  assert "diloco (published law (Charles et al. 2025), not fitted here):" in lines
  dense, diloco = 18.129 * 1.3e9 ** -0.0953, 21.051 * 1.3e9 ** -0.1018
  assert f"predicted loss {dense:.4f}" in line(lines, "dense (bf16")
  assert line(lines, "predicted loss:").startswith(f"  predicted loss: {diloco:.4f} (no interval")
  # Charles et al.'s own table at 1.3B: 2.460 vs 2.493, +1.3%.
  assert "(+1.31% over dense's" in line(lines, "predicted loss:")
  sent = float(line(lines, "bytes a step").split(": ")[1].replace(",", ""))
  shapes = plan.stand_in_shapes(1.3e9)
  assert equal_bytes.method_bytes("dense", shapes, 8) / sent == pytest.approx(30, rel=0.01)
  assert "H=30, exchange=dense" in line(lines, "runs:")
  assert line(lines, "recommended:").startswith("recommended: diloco (")
  assert "rests on the published law (Charles et al. 2025)" in line(lines, "recommended:")
  for family in ("diloco_int8", "streaming_diloco", "sparseloco", "demo", "onebit_adam"):
    assert line(lines, f"{family}:").startswith(f"{family}: no law yet")
  assert not [text for text in lines if text.startswith("warning:")]  # inside 35M-2.4B


def test_the_cpu_tier_gets_dense_and_a_warning_that_the_law_is_extrapolated(tmp_path, capsys):
  lines = run(SETUPS["cpu tier"], tmp_path, capsys)
  assert line(lines, "recommended:").startswith("recommended: dense")
  assert "149x below its law's fitted sizes" in line(lines, "warning: diloco")
  assert "more than 10x" in line(lines, "warning: diloco")
  assert "1,000 steps of 4,096 tokens" in lines[0]


def test_a_100m_model_on_64_workers_warns_of_the_replicas(tmp_path, capsys):
  lines = run(SETUPS["100M"], tmp_path, capsys)
  assert "the laws are at 8 workers (S1-LM's grid; the published law's replicas); 64 workers " \
         "extrapolates in M" in line(lines, "warning: the laws")
  assert line(lines, "recommended:").startswith(("recommended: diloco", "recommended: dense"))


def test_dense_is_priced_by_the_time_model_as_bf16_overlapped():
  setup = plan.make_setup(plan.parse(SETUPS["100M"]))
  steps = round(2e9 / setup.batch_tokens)
  times = step_time.kind_times("bf16", plan.stand_in_shapes(1e8),
                               topo.Topology.flat(64, setup.link), setup.compute)
  assert plan.run_seconds("dense", 1e8, setup) == pytest.approx(
      steps * next(iter(times.values())).total)
  assert setup.compute == pytest.approx(6 * 1e8 * setup.batch_tokens / 64 / (989e12 * 0.4))
  assert sum(map(lambda s: s[0] * (s[1] if len(s) > 1 else 1),
                 plan.stand_in_shapes(1234567))) == 1234567


def test_one_bit_adam_runs_its_published_warm_up_and_is_charged_its_dense_steps():
  """As S1-LM's rows: the dense warm-up is 15% of the run, and the bytes a step are the run's
  mean, the warm-up's dense all-reduce included (not only a compressed step's)."""
  shapes, steps = plan.stand_in_shapes(235264), 1000
  method, settings, _, sent = plan.solved("onebit_adam", shapes, 8, steps)
  assert method == "onebit_adam" and settings.freeze_step == 150
  dense = equal_bytes.method_bytes("dense", shapes, 8)
  compressed = equal_bytes.method_bytes("onebit_adam", shapes, 8, settings)
  assert compressed < dense / 20
  assert sent == pytest.approx((150 * dense + 850 * compressed) / 1000)
  assert dense / sent == pytest.approx(1 / (0.15 + 0.85 * compressed / dense))


FITS = """family,description,sizes,ratio,A,A_low,A_high,alpha,alpha_low,alpha_high,\
holdout_residual,crossing_params,crossing_low,crossing_high,crossing_tokens,crossing,loss_A,\
loss_A_low,loss_A_high,loss_alpha,loss_alpha_low,loss_alpha_high,loss_holdout_residual,note
dense,dense,37104 1063680,,,,,,,,,,,,,,20,19,21,-0.12,-0.13,-0.11,0.001,
solo,solo,37104 1063680,,,,,,,,,,,,,,21,20,22,-0.11,-0.12,-0.10,0.001,
demo,DeMo,37104 1063680,100,0.5,0.4,0.6,-0.2,-0.22,-0.18,0.001,1e5,6e4,1.3e5,2e6,x,20.2,20,\
20.4,-0.12,-0.125,-0.118,0.001,
"""
# DeMo's retention-law draws beside the fits (A, alpha): a steeper law starts higher.
DRAWS = [(0.5 * np.exp(0.1 * z), -0.2 - 0.01 * z) for z in np.linspace(-2, 2, 41)]


def write_fits(folder, text=FITS):
  (folder / "s1_lm_fits.csv").write_text(text)
  (folder / "s1_lm_fits_draws.csv").write_text(
      "family,A,alpha\n" + "".join(f"demo,{float(a)!r},{float(b)!r}\n" for a, b in DRAWS))
  return folder / "s1_lm_fits.csv"


def test_a_plan_from_the_grid_s_fits_has_intervals_and_writes_a_config(tmp_path, capsys):
  fits = write_fits(tmp_path)
  out = tmp_path / "chosen.json"
  plan.main(["--params=2e6", "--tokens=4e7", "--workers=8", "--bandwidth_gbit=1",
             "--device=cpu", f"--fits={fits}", f"--write_config={out}"])
  lines = capsys.readouterr().out.splitlines()
  assert "demo (S1-LM fit (s1_lm_fits.csv)):" in lines
  kept = 1 - 0.5 * 2e6 ** -0.2
  # The draws' predictions' 2.5th and 97.5th percentiles (of 41: the 2nd lowest and highest).
  ends = sorted(1 - a * 2e6 ** b for a, b in DRAWS)[1:-1:38]
  assert line(lines, "predicted retention:") == (
      f"  predicted retention: {kept:.3f} [{ends[0]:.4g}, {ends[1]:.4g}]")
  assert line(lines, "diloco_int8:").startswith("diloco_int8: no law yet")
  assert "beyond its law's fitted sizes" in line(lines, "warning: demo")
  written = json.loads(out.read_text())
  assert written["method"] in ("demo", "bf16")
  if written["method"] == "demo":
    assert written["compression"]["demo"]["topk"] >= 1


def test_a_plan_from_an_unfinished_grid_says_its_laws_are_provisional(tmp_path, capsys):
  fits = tmp_path / "s1_lm_fits.csv"
  status = "incomplete: of 56 rows, 7 have no run, 3 are still tuning, 20 lack seeds"
  header, *rows = FITS.strip().splitlines()
  fits.write_text("\n".join([header + ",grid", *(f'{r},"{status}"' for r in rows)]) + "\n")
  plan.main(["--params=2e6", "--tokens=4e7", "--workers=8", "--bandwidth_gbit=1",
             "--device=cpu", f"--fits={fits}"])
  lines = capsys.readouterr().out.splitlines()
  assert "demo (S1-LM fit (s1_lm_fits.csv), provisional):" in lines
  assert [l for l in lines if "provisional (python" in l] == [
      f"warning: S1-LM's grid had not finished its rows for these laws: demo's ({status}): "
      "they are provisional (python -m experiments.reproduce --target=s1_lm resumes the grid)"]
  complete = tmp_path / "complete.csv"
  complete.write_text(fits.read_text().replace(f'"{status}"', "complete"))
  plan.main(["--params=2e6", "--tokens=4e7", "--workers=8", "--bandwidth_gbit=1",
             "--device=cpu", f"--fits={complete}"])
  assert "provisional" not in capsys.readouterr().out


def test_one_family_s_unfinished_rows_mark_its_law_alone_provisional(tmp_path, capsys):
  """Per family (the fits CSV's grid column is each family's own): one dense line per source,
  whatever the families' states."""
  header, *rows = FITS.strip().splitlines()
  demo = next(r for r in rows if r.startswith("demo,"))
  status = "incomplete: of 24 rows, 3 have no run, 0 are still tuning, 0 lack seeds"
  fits = tmp_path / "s1_lm_fits.csv"
  fits.write_text("\n".join([header + ",grid", *(f"{r},complete" for r in rows),
                             demo.replace("demo,", "sparseloco,", 1) + f',"{status}"']) + "\n")
  plan.main(["--params=2e6", "--tokens=4e7", "--workers=8", "--bandwidth_gbit=1",
             "--device=cpu", f"--fits={fits}"])
  lines = capsys.readouterr().out.splitlines()
  assert "demo (S1-LM fit (s1_lm_fits.csv)):" in lines
  assert "sparseloco (S1-LM fit (s1_lm_fits.csv), provisional):" in lines
  assert len([l for l in lines if l.startswith("dense (bf16")]) == 2  # S1-LM's, the published
  assert f"sparseloco's ({status})" in line(lines, "warning: S1-LM's grid")


def test_the_recommendation_prefers_a_law_used_near_its_fitted_sizes(tmp_path, capsys):
  """At 1.3B, DeMo's S1-LM law (fitted at 37K-1.1M, 1,222x away) reaches dense's loss sooner
  than the published DiLoCo law (fitted at 35M-2.4B), which is recommended; each family's loss
  is set against its own source's dense."""
  fits = write_fits(tmp_path)
  plan.main([*SETUPS["1.3B"], f"--fits={fits}"])
  lines = capsys.readouterr().out.splitlines()
  times = [float(l.split(": ")[-1].rstrip("x")) for l in lines if "time to dense's loss" in l]
  assert len(times) == 2 and times[0] > times[1]  # demo's, then diloco's speed-up
  assert line(lines, "recommended:").startswith("recommended: diloco (")
  dense_lines = [l for l in lines if l.startswith("dense (bf16")]
  assert [l.rsplit("(L = ", 1)[1] for l in dense_lines] == [
      "20 N^-0.12, S1-LM fit (s1_lm_fits.csv))",
      "18.129 N^-0.0953, published law (Charles et al. 2025), not fitted here)"]
  assert f"over dense's {20 * 1.3e9 ** -0.12:.4f})" in line(lines, "predicted loss:")


def test_a_recommendation_resting_on_a_far_extrapolation_says_so():
  law = plan.PUBLISHED_LAW
  far = lambda family, seconds, factor: plan.Plan(
      family, law, family, 1.0, 3.0, None, None, None, seconds, None, 1.0, True, 2.9, factor)
  text, best = plan.recommend([far("demo", 10.0, 50.0), far("diloco", 20.0, 12.0)], 100.0)
  assert best.family == "demo"
  assert text.endswith("its law is extrapolated 50x beyond its fitted sizes, and every law "
                       "that beats dense here more than 10x: a hypothesis to test, not a "
                       "prediction")
  text, best = plan.recommend([far("demo", 10.0, 50.0), far("diloco", 20.0, 3.0)], 100.0)
  assert best.family == "diloco" and "hypothesis" not in text
  # The faster law set aside for its extrapolation is named, with what it predicts.
  assert text.endswith("; demo's law, extrapolated 50x beyond its fitted sizes, predicts 10x "
                       "sooner, not recommended over a law used within 10x of its own")
  assert "demo's law" not in plan.recommend([far("demo", 30.0, 50.0), far("diloco", 20.0, 3.0)],
                                            100.0)[0]  # slower than the recommendation
  assert plan.recommend([far("demo", 200.0, 1.0)], 100.0)[1] is None  # slower than dense


def test_a_provisional_law_is_printed_but_not_recommended_beside_a_finished_one():
  """A law fitted while its family's rows were still running (S1-LM's 1-bit Adam, its runs
  redone, once fitted a step from 0.41 to 1.09 over two sizes) is recommended only where no
  law is finished; the line says what it would have predicted."""
  status = "incomplete: of 24 rows, 3 have no run, 3 are still tuning, 4 lack seeds"
  make = lambda family, seconds, grid: plan.Plan(
      family, plan.PUBLISHED_LAW._replace(family=family, grid=grid), family, 1.0, 3.0, None,
      None, None, seconds, None, 1.0, True, 2.9, 1.0)
  finished, early = make("demo", 50.0, "complete"), make("onebit_adam", 10.0, status)
  text, best = plan.recommend([finished, early], 100.0)
  assert best.family == "demo"
  assert text.endswith("; onebit_adam's provisional law (its rows still running) predicts 10x "
                       "sooner, not recommended until they have run")
  text, best = plan.recommend([make("demo", 200.0, "complete"), early], 100.0)
  assert best is None and text.startswith("dense (bf16 all-reduce overlapped with the backward "
                                          "pass): no family with a finished law reaches")
  # Every law provisional (a grid early on): the soonest is still recommended.
  assert plan.recommend([make("demo", 50.0, status), early], 100.0)[1].family == "onebit_adam"
  # A provisional law slower than the recommendation goes unmentioned.
  assert "sparseloco" not in plan.recommend([finished, make("sparseloco", 80.0, status)],
                                            100.0)[0]


@pytest.mark.parametrize("change, message", [
    ({"--params": "-1"}, "--params=-1: allowed a number > 0"),
    ({"--params": "0"}, "--params=0: allowed a number > 0"),
    ({"--tokens": "0"}, "--tokens=0: allowed a number > 0"),
    ({"--workers": "1"}, "--workers=1: allowed an integer >= 2"),
    ({"--workers": "2.5"}, "--workers=2.5: allowed an integer >= 2"),
    ({"--bandwidth_gbit": "-10"}, "--bandwidth_gbit=-10: allowed a number > 0"),
    ({"--latency_us": "-1"}, "--latency_us=-1: allowed a number >= 0"),
    ({"--step_seconds": "0"}, "--step_seconds=0: allowed a number > 0"),
    ({"--memory_gb": "nan"}, "--memory_gb=nan: allowed a number > 0"),
    ({"--params": None}, "the following arguments are required: --params"),
    ({"--tokens": None}, "the following arguments are required: --tokens"),
])
def test_bad_input_is_refused_in_one_line_naming_the_flag(change, message, monkeypatch):
  monkeypatch.delenv(cli.VERBOSE_ENV, raising=False)
  args = dict(a.split("=", 1) for a in SETUPS["1.3B"])
  args.update(change)
  with pytest.raises(SystemExit) as exited:
    plan.main([f"{k}={v}" for k, v in args.items() if v is not None])
  assert exited.value.code == f"experiments.plan: {message}"


def readme_plans() -> list[tuple[list[str], list[str]]]:
  """``(argv, printed lines)`` of every ``$ python -m experiments.plan`` the README shows."""
  text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
  out = []
  for block in re.findall(r"```text\n(.*?)```", text, flags=re.S):
    for command in re.split(r"^(?=\$ )", block, flags=re.M):
      first, *printed = command.rstrip("\n").split("\n")
      if first.startswith(f"$ python -m {plan.PROGRAM} "):
        out.append((first.split()[4:], printed))
  return out


def test_the_readme_shows_what_the_plan_prints_from_the_committed_fits(capsys):
  plans = readme_plans()
  assert [argv for argv, _ in plans] == list(SETUPS.values())
  for argv, printed in plans:
    plan.main(argv)  # the default fits: paper_figures/s1_lm_fits.csv, as committed
    assert capsys.readouterr().out.splitlines() == printed, (
        f"the README's output of `python -m experiments.plan {' '.join(argv)}` is not what it "
        "prints from paper_figures/s1_lm_fits.csv: paste the command's output into the README")
