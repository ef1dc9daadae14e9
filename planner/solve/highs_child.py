"""HiGHS on a model file, in a process of its own (:mod:`planner.solve.ilp`'s hard time limit).

HiGHS checks its time limit and its interrupt callbacks only between phases: in the root's
cut separation it can run minutes past the limit (the example's layer 0 at EP 4: 431 s under
a 60 s limit, with an interrupt requested at 61 s). So the ILP runs this script as a child
process that its parent can kill at the deadline; each improving solution is saved as it
is found, so a killed solve still returns the best placement found.

    python highs_child.py MODEL.mps OPTIONS_JSON START.npy|"" OUT_DIR

Writes ``OUT_DIR/incumbent.npz`` at every improving solution and ``OUT_DIR/result.npz``
when HiGHS returns (``x`` column values, ``status`` the model status as an int, ``objective``,
``bound`` the MIP dual bound, ``valid`` whether ``x`` holds a solution). Imports only numpy
and highspy (it runs as a script, not through the package), so it starts in a fraction of a
second.
"""

from __future__ import annotations

import json
import os
import signal
import sys

if __name__ == "__main__":
    # A terminal's Ctrl-C reaches the whole process group: the parent stops this child
    # itself, and a KeyboardInterrupt here printed a traceback beside the parent's line.
    # Ignored before the imports, which take most of the child's start.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

import highspy  # noqa: E402
import numpy as np  # noqa: E402

INCUMBENT = "incumbent.npz"
RESULT = "result.npz"


def _save(path: str, **arrays) -> None:
    """np.savez to ``path`` atomically: a reader never sees half a file."""
    tmp = path + ".part.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def die_with_parent() -> None:
    """Be killed when the parent dies (Linux): a moeplan terminated mid-solve must not leave
    a solver running for the rest of its time limit, or longer (it overruns it). Also run in
    CBC's process before it starts (``planner.solve.ilp._CbcWithDeadline``)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's deadline still kills it
        return
    if os.getppid() == 1:  # the parent died before the call
        os._exit(1)


def main(model: str, options: str, start: str, out_dir: str) -> int:
    die_with_parent()
    h = highspy.Highs()
    settings = json.loads(options)
    h.setOptionValue("output_flag", bool(settings.pop("output_flag", False)))
    if h.readModel(model) != highspy.HighsStatus.kOk:
        return 3
    for key, value in settings.items():  # after the read: a time limit would also bound it
        h.setOptionValue(key, value)
    if start:
        solution = highspy.HighsSolution()
        solution.col_value = np.load(start).tolist()
        solution.value_valid = True
        h.setSolution(solution)
    incumbent = os.path.join(out_dir, INCUMBENT)

    def improved(event) -> None:
        out = event.data_out
        _save(incumbent, x=np.asarray(out.mip_solution, dtype=np.float64),
              objective=float(out.objective_function_value), bound=float(out.mip_dual_bound))  # fmt: skip

    h.cbMipImprovingSolution += improved
    h.run()
    solution = h.getSolution()
    _save(
        os.path.join(out_dir, RESULT),
        x=np.asarray(solution.col_value, dtype=np.float64),
        status=int(h.getModelStatus()),
        objective=float(h.getObjectiveValue()),
        bound=float(h.getInfo().mip_dual_bound),
        # a feasible point, not merely values: stopped at its time limit, HiGHS hands back
        # a start it rejected (one that breaks the cap) with value_valid set
        valid=int(h.getInfo().primal_solution_status) == 2,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
