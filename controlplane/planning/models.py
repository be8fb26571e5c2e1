"""What the planner decided, per pipeline and worker group, each interval: the dashboard's and the API's record.

Not audited: the rows are themselves the planner's log (one per group per interval), and a change it makes
is audited by the scale action it calls. Each pipeline keeps its latest ``KEEP_PER_PIPELINE`` rows.
"""

from typing import ClassVar

from django.db import models

#: Decisions kept per pipeline: at one per group every 10 s, about 40 minutes of a disaggregated pipeline.
KEEP_PER_PIPELINE = 500


class PlannerDecision(models.Model):
    """One group's decision at ``at`` (planner/decision.py ``Decision``), whether it was acted on, and what
    the planner saw: TTFT/ITL measured at ``percentile`` over the interval, and the traffic it predicted for
    the next one (requests/s, mean prompt and completion tokens). ``acted``: the group was scaled to
    ``desired``; false for a hold, an advisory decision, or a scale-up that could not be placed (the reason
    says so)."""

    pipeline = models.ForeignKey("deployments.Pipeline", on_delete=models.CASCADE, related_name="planner_decisions")
    role = models.CharField(max_length=12)
    at = models.DateTimeField()
    current = models.PositiveIntegerField()
    desired = models.PositiveIntegerField()
    wanted = models.PositiveIntegerField()
    mode = models.CharField(max_length=8)  # sla, load, off
    bound = models.CharField(max_length=16, blank=True)
    advisory = models.BooleanField(default=False)
    acted = models.BooleanField(default=False)
    reason = models.TextField()
    percentile = models.FloatField(null=True, blank=True)
    ttft_s = models.FloatField(null=True, blank=True)
    itl_s = models.FloatField(null=True, blank=True)
    predicted_rate = models.FloatField(null=True, blank=True)
    predicted_isl = models.FloatField(null=True, blank=True)
    predicted_osl = models.FloatField(null=True, blank=True)

    class Meta:
        ordering: ClassVar = ["-at", "-id"]
        indexes: ClassVar = [models.Index(fields=["pipeline", "-at"])]

    def __str__(self) -> str:
        return f"{self.pipeline_id}/{self.role} {self.current}->{self.desired} at {self.at.isoformat()}"

    @property
    def change(self) -> int:
        return self.desired - self.current
