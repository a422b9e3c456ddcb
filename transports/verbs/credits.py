"""Credit-based flow control for one peer, as pure accounting (no pyverbs).

Every message is an RDMA WRITE WITH IMMEDIATE and consumes one receive work request at the
peer (and, for CTRL, one inbox slot). A sender may therefore have at most `limit` messages the
peer has not yet processed: it spends a credit per message, and gets credits back in the
`credits` field of the peer's immediates. Without this an eager sender would find no receive
request posted (RNR: the NIC retries, then kills the connection) or overwrite an unread slot.

The receiving half counts messages processed but not yet returned (`owed`). They ride back on
the next message to that peer; when none is going and `owed` reaches half the window, an
explicit CREDIT message carries them. CREDIT messages are not themselves credited: at most two
can be unread at once (each returns at least limit/2 of the limit credits in circulation), so
the peer keeps CREDIT_RESERVE receive requests posted beyond `limit`.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from .wire import MAX_CREDITS

CREDIT_RESERVE = 4


class CreditWindow:
    def __init__(self, limit: int):
        if not 1 <= limit <= MAX_CREDITS:
            raise ValueError(f"credit limit {limit} outside 1..{MAX_CREDITS}")
        self.limit = limit
        self.available = limit      # messages we may still send
        self.owed = 0               # messages we processed and have not yet returned

    # ---- sending half --------------------------------------------------------------------
    def try_take(self) -> bool:
        """Spend one credit for a message; False (and nothing spent) when none is left."""
        if self.available == 0:
            return False
        self.available -= 1
        return True

    def restore(self, n: int) -> None:
        """The peer returned n credits."""
        if n < 0 or self.available + n > self.limit:
            raise ValueError(f"peer returned {n} credits with {self.available} of {self.limit} "
                             "available: the peer's accounting is broken")
        self.available += n

    # ---- receiving half ------------------------------------------------------------------
    def processed(self) -> None:
        """We consumed one credited message from the peer (its slot and receive request are free)."""
        if self.owed >= self.limit:
            raise ValueError(f"peer sent more than its {self.limit} credits")
        self.owed += 1

    def to_return(self) -> int:
        """Credits to put into the next outgoing immediate (all of them; cleared here)."""
        n, self.owed = self.owed, 0
        return n

    def needs_explicit_return(self) -> bool:
        """Whether to send a CREDIT message now, no other message going to the peer."""
        return self.owed >= max(1, self.limit // 2)


class Outbox:
    """Messages to one peer waiting for a credit, sent strictly in posting order: a message
    never overtakes an earlier one (the receiver matches CTS records and data by order)."""

    def __init__(self, window: CreditWindow):
        self.window = window
        self._queue: deque = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, message) -> None:
        self._queue.append(message)

    def flush(self, post: Callable[[object, int], None]) -> int:
        """post(message, credits_returned) for each queued message a credit is free for; the
        returned credits ride along on each. Returns how many were posted."""
        sent = 0
        while self._queue and self.window.try_take():
            post(self._queue.popleft(), self.window.to_return())
            sent += 1
        return sent
