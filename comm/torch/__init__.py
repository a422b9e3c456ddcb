"""The torch.distributed backend "comm": ``dist.init_process_group("comm")`` runs on this library.

    backend.py   ProcessGroupComm, the group torch calls; register()
    work.py      the Work torch sees, its completion thread, comm's errors as DistBackendError
    args.py      torch's argument forms and reduce ops as comm's, tensors staged for comm
    sparse.py    sparse (COO) all_reduce
    store.py     torch's Store as comm's (the backend's communicators; comm.init under torchrun)
    torchft.py   torchft's reconfigurable ProcessGroupComm (imports torchft: not loaded here)

Importing this package, or any module of it, registers the backend. So does ``import torch``
where the package is installed: torch's backend autoload calls the ``torch.backends`` entry
point (comm_collectives_autoload), which imports this package.

Import order: torch imports that entry point from inside ``import torch``. This package
therefore imports torch before any module of its own, so whoever imports it first (torch's
autoload, comm.init under torchrun, a user's ``import comm.torch.store``), torch's autoload
never finds a module of it half-imported: where this very import is what starts ``import torch``,
the autoload finds the package itself mid-import (nothing of it run yet, so it does nothing)
and the registration below happens as soon as torch is imported.
"""
from __future__ import annotations

import torch  # noqa: F401  (first: see above; absolute, so the real torch, not this package)

from .backend import register

register()
