"""The import hook ``sparse-ckpt-run`` puts into every Python process its command starts.

This folder leads ``PYTHONPATH`` in the command's environment, so every Python interpreter the
command starts (the command itself, torchrun and Accelerate workers, ``multiprocessing`` spawn
children, subprocesses, Ray workers started in that environment) imports its ``sitecustomize``,
which calls `start`. Standard library only, and nothing heavy at interpreter start: `start` puts a
finder at the front of ``sys.meta_path`` that watches only the modules in `INTEGRATIONS`'
triggers, then runs the ``sitecustomize`` this folder shadows, if any (``usercustomize`` is not
shadowed and runs as usual). A process that never imports a trigger never imports torch or
sparse_ckpt because of this hook.

When a trigger module has finished importing (and no other trigger is still being imported, so a
trainer package that imports DSD while it initialises is routed together with DSD, in one log
line), the finder imports ``sparse_ckpt.launcher.activate`` and calls its ``activate`` with the
selected integrations whose triggers were imported; then it leaves ``sys.meta_path`` once every
selected integration has been handled.

Environment (set by ``sparse-ckpt-run`` from its options; docs/launcher.md):

- ``SPARSE_CKPT_RUN``: ``0``, ``off``, ``false`` or ``no`` turns everything off (the hook only
  runs the shadowed ``sitecustomize``);
- ``SPARSE_CKPT_INTEGRATIONS``: comma-separated; ``auto`` (the default) is every integration
  marked default, ``none`` is none, ``-name`` removes one, a name adds one;
- ``SPARSE_CKPT_RUN_STRICT``: ``1`` makes a failed activation an error in the importing process
  instead of a warning and a stock run;
- ``SPARSE_CKPT_RUN_LOG``: ``auto`` (default) or ``logging`` (see ``activate``);
- ``SPARSE_CKPT_SAFE_LOAD``: ``1`` selects the ``safe_load`` integration (``sparse-ckpt-run --safe-load``);
- ``SPARSE_CKPT_RUN_HOME``: the folder holding the ``sparse_ckpt`` package, appended to
  ``sys.path`` only when ``sparse_ckpt`` cannot be imported otherwise.
"""

from __future__ import annotations

import os
import sys

__all__ = ["INTEGRATIONS", "Integration", "enabled", "outcomes", "safe_load", "selection", "start", "strict"]

OFF = ("0", "off", "false", "no")
ON = ("1", "on", "true", "yes")


class Integration:
    """One integration the hook can activate: ``module.function()`` once ``triggers`` were imported."""

    __slots__ = ("conflicts", "default", "function", "module", "name", "routes", "triggers")

    def __init__(
        self,
        name: str,
        triggers: tuple,
        module: str,
        routes: str,
        *,
        default: bool = True,
        conflicts: tuple = (),
        function: str = "install",
    ) -> None:
        self.name = name
        self.triggers = triggers
        self.module = module
        self.routes = routes
        self.default = default
        self.conflicts = conflicts
        self.function = function


INTEGRATIONS = {
    i.name: i
    for i in (
        Integration(
            "dsd",
            ("torch.distributed.checkpoint.state_dict",),
            "sparse_ckpt.integrations.dsd",
            "torch DSD (get/set_optimizer_state_dict, get/set_state_dict, DefaultLoadPlanner.set_up_planner)",
        ),
        Integration(
            "torchtune",
            ("torchtune",),
            "sparse_ckpt.integrations.torchtune",
            "torchtune's optimizer checkpointing",
        ),
        Integration(
            "veomni",
            ("veomni.checkpoint",),
            "sparse_ckpt.integrations.veomni",
            "VeOmni's build_checkpointer('dcp', ...)",
        ),
        Integration(
            "accelerate",
            ("accelerate",),
            "sparse_ckpt.integrations.accelerate",
            "Accelerate's save_fsdp_optimizer/load_fsdp_optimizer (sparse_ckpt's packed format)",
            default=False,
            conflicts=("dsd",),
        ),
        Integration(
            "safe_load",
            ("torch.distributed.checkpoint",),
            "sparse_ckpt.integrations.safe_load",
            "every DCP FileSystemReader load (.metadata by a restricted unpickler, bytes items weights-only, "
            "no read outside the checkpoint)",
            default=False,
        ),
    )
}
"""Name -> `Integration`, in activation order. ``accelerate`` is opt-in and conflicts with ``dsd``:
both would own Accelerate's optimizer checkpoints, in two different on-disk layouts. ``safe_load`` is
opt-in, and selected whenever ``SPARSE_CKPT_SAFE_LOAD`` is on (`safe_load`)."""


def enabled(environ: dict | None = None) -> bool:
    """Whether ``SPARSE_CKPT_RUN`` leaves the hook on (anything but ``0``/``off``/``false``/``no``)."""
    env = os.environ if environ is None else environ
    return env.get("SPARSE_CKPT_RUN", "1").strip().lower() not in OFF


def strict(environ: dict | None = None) -> bool:
    """Whether ``SPARSE_CKPT_RUN_STRICT`` asks for a hard failure when an activation fails."""
    env = os.environ if environ is None else environ
    return env.get("SPARSE_CKPT_RUN_STRICT", "0").strip().lower() in ON


def safe_load(environ: dict | None = None) -> bool:
    """Whether ``SPARSE_CKPT_SAFE_LOAD`` (``sparse-ckpt-run --safe-load``) asks for the ``safe_load`` integration."""
    env = os.environ if environ is None else environ
    return env.get("SPARSE_CKPT_SAFE_LOAD", "0").strip().lower() in ON


def selection(value: str | None = None, environ: dict | None = None) -> tuple[list[str], list[str]]:
    """``(selected integration names in activation order, problems)`` for a ``SPARSE_CKPT_INTEGRATIONS``
    value (default: the environment's, else ``auto``), plus ``safe_load`` when `safe_load` (of
    ``environ``, default the process's). A problem is an unknown name or two conflicting integrations
    (the later one in `INTEGRATIONS` order is dropped)."""
    if value is None:
        value = os.environ.get("SPARSE_CKPT_INTEGRATIONS", "auto")
    chosen: set[str] = set()
    problems = []
    for token in (t.strip().lower() for t in value.split(",")):
        if not token:
            continue
        name = token.removeprefix("-")
        if name == "auto":
            names = {n for n, i in INTEGRATIONS.items() if i.default}
        elif name == "none":
            names = set(INTEGRATIONS)
            if not token.startswith("-"):
                chosen.clear()
                continue
        elif name in INTEGRATIONS:
            names = {name}
        else:
            problems.append(
                f"unknown integration {name!r} in SPARSE_CKPT_INTEGRATIONS (known: {', '.join(INTEGRATIONS)})"
            )
            continue
        if token.startswith("-"):
            chosen -= names
        else:
            chosen |= names
    if safe_load(environ):
        chosen.add("safe_load")
    selected: list[str] = []
    for name, integration in INTEGRATIONS.items():
        if name not in chosen:
            continue
        clash = [c for c in selected if c in integration.conflicts or name in INTEGRATIONS[c].conflicts]
        if clash:
            problems.append(
                f"integrations {clash[0]!r} and {name!r} conflict (both would own the same checkpoints); {name!r} is "
                "not activated"
            )
            continue
        selected.append(name)
    return selected, problems


class _Hook:
    """The ``sys.meta_path`` finder: wraps the loaders of the selected integrations' trigger modules."""

    def __init__(self, selected: list[str], problems: list[str]) -> None:
        import _thread

        self.selected = selected
        self.problems = problems
        self.watched = {t: n for n in selected for t in INTEGRATIONS[n].triggers}
        self.fired: set[str] = set()
        self.pending: list[str] = []
        self.outcomes: list[dict] = []
        self.local = _thread._local()
        self.lock = _thread.allocate_lock()

    # the finder protocol -------------------------------------------------------------------
    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if name not in self.watched or getattr(self.local, "finding", False):
            return None
        self.local.finding = True  # other finders may call importlib.util.find_spec: no recursion
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        finally:
            self.local.finding = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, self, name)
        return spec

    def invalidate_caches(self) -> None:
        pass

    # events -----------------------------------------------------------------------------------
    def entering(self) -> None:
        self.local.depth = getattr(self.local, "depth", 0) + 1

    def leaving(self, name: str | None) -> None:
        """A watched module finished executing (``name``, or ``None`` when it failed)."""
        self.local.depth -= 1
        with self.lock:
            if name is not None:
                integration = self.watched.get(name)
                if integration is not None and integration not in self.fired and integration not in self.pending:
                    self.pending.append(integration)
            if self.local.depth or not self.pending:
                return
            names, self.pending = [n for n in self.selected if n in self.pending], []
            self.fired.update(names)
            if self.fired.issuperset(self.selected):
                _leave(self)
        self.outcomes.extend(_activate(names, self.problems if len(self.fired) == len(names) else []))


class _Loader:
    """The trigger module's own loader, telling the hook when the module has been executed. The
    module and its spec get the original loader back before it runs."""

    def __init__(self, loader: object, hook: _Hook, name: str) -> None:
        self.loader = loader
        self.hook = hook
        self.name = name

    def create_module(self, spec: object) -> object:
        return self.loader.create_module(spec)  # type: ignore[attr-defined]

    def exec_module(self, module: object) -> None:
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self.loader
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self.loader  # type: ignore[attr-defined]
        self.hook.entering()
        done = None
        try:
            self.loader.exec_module(module)  # type: ignore[attr-defined]
            done = self.name
        finally:
            self.hook.leaving(done)

    def __getattr__(self, name: str) -> object:
        return getattr(self.loader, name)


def _leave(hook: _Hook) -> None:
    try:
        sys.meta_path.remove(hook)
    except ValueError:
        pass


def _activate(names: list[str], problems: list[str]) -> list[dict]:
    """Import sparse_ckpt and activate ``names`` (``sparse_ckpt.launcher.activate``); a failure to
    import sparse_ckpt at all is a warning (or, strict, an error) like a failed activation."""
    try:
        try:
            import sparse_ckpt.launcher.activate as activation
        except ModuleNotFoundError as exc:
            home = os.environ.get("SPARSE_CKPT_RUN_HOME")
            if exc.name != "sparse_ckpt" or not home or home in sys.path:
                raise
            sys.path.append(home)
            import sparse_ckpt.launcher.activate as activation
    except Exception as exc:
        message = f"sparse-ckpt-run: sparse_ckpt cannot be imported by {sys.executable} ({type(exc).__name__}: {exc})"
        if strict():
            raise ImportError(
                f"{message}; SPARSE_CKPT_RUN_STRICT=1 (sparse-ckpt-run --strict): this process stops here "
                f"instead of running without {', '.join(names)}"
            ) from exc
        message += f"; this process runs stock, without {', '.join(names)}"
        sys.stderr.write(f"WARNING {message}\n")
        return [{"integration": n, "status": "failed", "detail": message} for n in names]
    return activation.activate(names, problems=problems, strict=strict())


_hook: _Hook | None = None


def outcomes() -> list[dict]:
    """What this process activated so far (one dict per integration: ``integration``, ``status``
    (``routed``, ``absent``, ``refused``, ``failed``) and ``detail``), for ``sparse-ckpt-run --check``."""
    return list(_hook.outcomes) if _hook is not None else []


def start() -> None:
    """Put the finder in place (when ``SPARSE_CKPT_RUN`` is not off), then run the shadowed ``sitecustomize``."""
    global _hook
    if enabled() and _hook is None:
        selected, problems = selection()
        if selected:
            _hook = _Hook(selected, problems)
            sys.meta_path.insert(0, _hook)
    _chain()


def _chain() -> None:
    """Run the ``sitecustomize`` this folder shadows: the next one on ``sys.path``. It becomes
    ``sys.modules["sitecustomize"]``; its errors propagate to ``site``, which reports them as it
    would have without this folder."""
    bootstrap, external = sys.modules.get("_frozen_importlib"), sys.modules.get("_frozen_importlib_external")
    if bootstrap is not None and external is not None:  # CPython: already loaded, nothing to import
        module_from_spec, PathFinder = bootstrap.module_from_spec, external.PathFinder
    else:  # pragma: no cover - other interpreters
        from importlib.machinery import PathFinder
        from importlib.util import module_from_spec
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)
