"""Instances get an incarnation: a random id per row (runtime/fleet_contract/tasks.py). AddField computes a
callable default once for every existing row, so each existing row is then given one of its own."""

from typing import Any

from django.db import migrations, models

import runtime.fleet_contract.tasks


def give_each_row_its_own(apps: Any, schema_editor: Any) -> None:
    Instance = apps.get_model("deployments", "Instance")
    for pk in Instance.objects.values_list("pk", flat=True):
        Instance.objects.filter(pk=pk).update(incarnation=runtime.fleet_contract.tasks.new_incarnation())


class Migration(migrations.Migration):
    dependencies = [
        ("deployments", "0008_pipeline_planner"),
    ]

    operations = [
        migrations.AddField(
            model_name="instance",
            name="incarnation",
            field=models.CharField(default=runtime.fleet_contract.tasks.new_incarnation, editable=False, max_length=32),
        ),
        migrations.RunPython(give_each_row_its_own, migrations.RunPython.noop),
    ]
