"""Turns on the stagefs feed hook in every Python process that has this directory on its path
(``eval "$(stagefs feed-env)"`` puts it on PYTHONPATH, so torchrun, srun, accelerate and
Lightning launchers pass it to every rank), then runs the sitecustomize this one shadows.

Installing the hook imports nothing heavy: it patches torch's DataLoader only if and when the
process imports it.
"""

import os
import sys


def _install_hook():
    try:
        import stagefs_feed

        stagefs_feed.install()
    except Exception as e:  # never stop an interpreter from starting
        print(f"stagefs-feed: warning: hook not installed: {e}", file=sys.stderr)


def _run_shadowed():
    """Python imports only the first sitecustomize on the path: run the next one (a
    distribution's or a site's own) as if it had been found."""
    here = os.path.dirname(os.path.abspath(__file__))
    seen_self = False
    for entry in sys.path:
        folder = os.path.abspath(entry or os.getcwd())
        if folder == here:
            seen_self = True
            continue
        candidate = os.path.join(folder, "sitecustomize.py")
        if seen_self and os.path.isfile(candidate):
            import importlib.util

            spec = importlib.util.spec_from_file_location("_stagefs_shadowed_sitecustomize", candidate)
            module = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(module)
            except Exception as e:
                print(f"stagefs-feed: warning: {candidate} failed: {e}", file=sys.stderr)
            return


_install_hook()
_run_shadowed()
