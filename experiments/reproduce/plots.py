"""Plotting the reports share: panels, axes and labels (matplotlib).

Each report's ``plot`` draws on the area :func:`experiments.reproduce.report.write_report` gives
it (Agg backend); these helpers place its panels and give every axes the same look: labels,
title, legend, grid, batch sizes or worker counts on a log-2 axis, labels beside points.
"""

from collections.abc import Sequence

from matplotlib import transforms

GRID_ALPHA = 0.3
_LABEL_OFFSET = 5  # points between a point and its label


def panels_in_a_row(fig, count: int, *, step: float, bottom: float, width: float,
                    height: float, left: float = 0.07) -> list:
  """``count`` axes side by side on ``fig``, ``step`` apart (figure fractions)."""
  return [fig.add_axes([left + step * i, bottom, width, height]) for i in range(count)]


def log2_axis(ax, ticks: Sequence[int]) -> None:
  """A log-2 x axis ticked at ``ticks`` (batch sizes, worker counts), each written in full."""
  ax.set_xscale("log", base=2)
  ax.set_xticks(list(ticks), [str(t) for t in ticks])


def decorate(ax, *, title: str | None = None, xlabel: str | None = None,
             ylabel: str | None = None, title_size: float | None = None,
             legend_size: float | None = None, legend_loc: str | None = None,
             grid: str | None = "both") -> None:
  """Labels, title, legend and grid of ``ax``; each left out where None (the legend unless
  ``legend_size`` is given; ``grid``: the axis or axes gridded, ``"x"``, ``"y"`` or ``"both"``)."""
  if xlabel is not None:
    ax.set_xlabel(xlabel)
  if ylabel is not None:
    ax.set_ylabel(ylabel)
  if title is not None:  # matplotlib's own title size unless one is given
    ax.set_title(title, **({} if title_size is None else {"fontsize": title_size}))
  if legend_size is not None:
    ax.legend(fontsize=legend_size, **({} if legend_loc is None else {"loc": legend_loc}))
  if grid is not None:
    ax.grid(alpha=GRID_ALPHA, axis=grid)


def legend_beside(ax) -> None:
  """``ax``'s legend to its right, outside it (for more lines than fit inside)."""
  ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.02, 1.0))


def label_points(ax, points: Sequence[tuple[float, float, str]], *, fontsize: float = 8) -> None:
  """Labels each ``(x, y, text)`` of ``ax`` beside its point, no label overlapping another or a
  point.

  Labels are placed from the lowest point up, each where it moves least from its point's height:
  right of it (or left), shifted up or down past the labels and points in the way, within the
  axes where it can be; a shifted label gets a thin line back to its point. Call it once the
  axes' scales and data are final.
  """
  ax.autoscale_view()  # the labels' positions depend on the final limits
  frame = ax.get_window_extent()
  marker = _LABEL_OFFSET * 0.8 * ax.figure.dpi / 72  # a marker's half-width, within the offset
  placed = [transforms.Bbox.from_extents(px - marker, py - marker, px + marker, py + marker)
            for px, py in ax.transData.transform([(x, y) for x, y, _ in points])]
  for x, y, text in sorted(points, key=lambda p: (p[1], p[0])):
    options = []
    for preference, (dx, ha) in enumerate(((_LABEL_OFFSET, "left"), (-_LABEL_OFFSET, "right"))):
      label = ax.annotate(text, (x, y), xytext=(dx, 0), textcoords="offset points",
                          fontsize=fontsize, ha=ha, va="center")
      box = label.get_window_extent()
      label.remove()
      beside = box.x0 < frame.x0 or box.x1 > frame.x1
      for direction in (1, -1):
        shift = _free_shift(box, placed, direction)
        moved = box.translated(0, shift)
        outside = beside or moved.y0 < frame.y0 or moved.y1 > frame.y1
        options.append((outside, abs(shift), preference, shift, dx, ha, moved))
    *_, shift, dx, ha, moved = min(options, key=lambda o: o[:3])
    lead = ({"arrowprops": {"arrowstyle": "-", "lw": 0.5, "color": "grey", "shrinkA": 0,
                            "shrinkB": 3}} if shift else {})
    ax.annotate(text, (x, y), xytext=(dx, shift * 72 / ax.figure.dpi), textcoords="offset points",
                fontsize=fontsize, ha=ha, va="center", **lead)
    placed.append(moved)


def _free_shift(box, placed, direction: int) -> float:
  """How far (display pixels, signed) ``box`` must move up (``direction`` 1) or down (-1) to
  overlap none of ``placed``, with a 2-pixel gap."""
  shift = 0.0
  while clashes := [b for b in placed if b.overlaps(box.translated(0, shift))]:
    shift = (max(b.y1 for b in clashes) - box.y0 + 2 if direction > 0 else
             min(b.y0 for b in clashes) - box.y1 - 2)
  return shift
