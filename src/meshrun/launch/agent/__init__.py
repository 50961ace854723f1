"""torchrun's elastic agent, run in the launcher's own process, and what meshrun adds around
it: the command line and defaults it is given (``local``), the environment it and its workers
see (``environment``), the workers' store port held until rank 0 listens (``store_port``), the
thread that watches it (``watch``: restarts said, a lost rendezvous left), the processes that
end with the launcher even when it is SIGKILLed (``orphans``) and the one-screen summary of a
failed job (``failures``). See docs/launch.md."""

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports

if TYPE_CHECKING:
    from meshrun.launch.agent.failures import summarize_failures
    from meshrun.launch.agent.local import launch_local
    from meshrun.launch.agent.orphans import orphan_guard

__getattr__ = lazy_exports(
    globals(),
    {
        "launch_local": "meshrun.launch.agent.local",
        "orphan_guard": "meshrun.launch.agent.orphans",
        "summarize_failures": "meshrun.launch.agent.failures",
    },
)

__all__ = ["launch_local", "orphan_guard", "summarize_failures"]
