"""Write failures the tests inject: what torch.save raises into a file over a disk quota."""
from __future__ import annotations

import errno


def torch_save_over_quota(obj, f, *args, **kwargs):
    """Stands for torch.save into a file over quota: torch's zip writer fails closing the
    archive with RuntimeError "unexpected pos ... vs ...", the OSError in its context."""
    try:
        raise OSError(errno.EDQUOT, "Disk quota exceeded")
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos "
                           "64 vs 10") from None
