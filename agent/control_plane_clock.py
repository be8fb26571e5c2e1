"""The control plane's clock as this agent estimates it, from the ``Date`` of the control plane's answers.

Fleet tasks say when they were issued on the control plane's clock and for how long they are valid
(runtime/fleet_contract/tasks.py's ``TaskStamp``). Judging that on the node's own clock would make two
clocks agree: a node 30 s ahead would discard every start, one behind would act on old orders. So the
agent judges it on the control plane's clock instead: every answer of the control plane carries a
``Date`` (HTTP servers send one), and its offset from the midpoint of the request on this node's clock is
the skew, to about a second (``Date`` has whole seconds), which tasks valid for half a minute or more can
afford. Until the control plane has answered once, the node's own clock stands in.
"""

import email.utils
import logging
import time

log = logging.getLogger(__name__)

#: A skew this large is worth a warning: the node's clock is wrong (its NTP, its RTC), whatever copes with it.
WARN_SKEW_S = 5.0


class ControlPlaneClock:
    """``now()`` on the control plane's clock, corrected by the last ``observe``d answer."""

    def __init__(self) -> None:
        #: The control plane's clock minus this node's, in seconds; None until an answer with a Date came.
        self.offset_s: float | None = None
        self._warned = False

    def observe(self, date_header: str | None, sent_at: float, received_at: float) -> None:
        """Take the skew from an answer's ``Date`` header, for a request sent at ``sent_at`` and answered at
        ``received_at`` (``time.time()`` on this node). A missing or malformed header changes nothing."""
        if not date_header:
            return
        try:
            answered = email.utils.parsedate_to_datetime(date_header).timestamp()
        except (TypeError, ValueError, IndexError, OverflowError):
            return
        # The Date is truncated to its second: the answer was made half a second after it, on average.
        offset = answered + 0.5 - (sent_at + received_at) / 2
        self.offset_s = offset
        if abs(offset) >= WARN_SKEW_S and not self._warned:
            self._warned = True
            log.warning(
                "this node's clock is %.0f s %s the control plane's: the agent judges its tasks' deadlines on the "
                "control plane's clock, but set up time synchronisation (NTP) on this node",
                abs(offset),
                "behind" if offset > 0 else "ahead of",
            )
        elif abs(offset) < WARN_SKEW_S and self._warned:
            self._warned = False
            log.info("this node's clock agrees with the control plane's again (%.1f s apart)", offset)

    def now(self) -> float:
        """The control plane's time now (UNIX seconds), as well as this node can tell."""
        return time.time() + (self.offset_s or 0.0)
