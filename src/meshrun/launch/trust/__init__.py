"""What lets a launch trust what it reads back from a store anyone can reach: where the job
secret comes from (``secret``; the key, its HMAC and its sanitizer are runtime/secret.py's) and
the rendezvous backend whose state is signed JSON, not a pickle (``rendezvous``). See
docs/security.md."""

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports

if TYPE_CHECKING:
    from meshrun.launch.trust.rendezvous import signed_backend_argv
    from meshrun.launch.trust.secret import resolve

__getattr__ = lazy_exports(
    globals(),
    {
        "resolve": "meshrun.launch.trust.secret",
        "signed_backend_argv": "meshrun.launch.trust.rendezvous",
    },
)

__all__ = ["resolve", "signed_backend_argv"]
