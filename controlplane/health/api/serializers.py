"""The shape of ``/api/v1/health/``, for the OpenAPI schema (the view builds the dict itself)."""

from rest_framework import serializers


class CheckSerializer(serializers.Serializer):
    ok = serializers.BooleanField()
    error = serializers.CharField(required=False, help_text="why not ok; only to people who are logged in")


class DatabaseCheckSerializer(CheckSerializer):
    pass


class BrokerCheckSerializer(CheckSerializer):
    url = serializers.CharField(required=False, help_text="the broker's URL, password hidden; only when logged in")


class ReconcilerCheckSerializer(CheckSerializer):
    last_pass_at = serializers.DateTimeField(allow_null=True, help_text="when the last pass finished; null: never")
    age_s = serializers.FloatField(allow_null=True, help_text="seconds since then, by the database's clock")
    late = serializers.BooleanField(help_text="no pass finished for late_after_s (or ever)")
    late_after_s = serializers.FloatField(help_text="3 × FLOTILLA_RECONCILE_S + 10")
    duration_s = serializers.FloatField(allow_null=True, help_text="how long the last pass took")
    summary = serializers.CharField(required=False, help_text="what the last pass did; only when logged in")


class AgentsCheckSerializer(CheckSerializer):
    online = serializers.IntegerField(help_text="nodes whose agent heartbeats")
    offline = serializers.IntegerField(help_text="nodes silent for longer than FLOTILLA_NODE_TIMEOUT_S")
    last_heartbeat_age_s = serializers.FloatField(allow_null=True, help_text="the freshest heartbeat's age")


class HealthSerializer(serializers.Serializer):
    status = serializers.ChoiceField(
        choices=["ok", "down"], help_text="down: the database, the broker or the reconciler is not ok"
    )
    database = DatabaseCheckSerializer()
    broker = BrokerCheckSerializer()
    reconciler = ReconcilerCheckSerializer()
    agents = AgentsCheckSerializer(help_text="reported, but not part of status")
