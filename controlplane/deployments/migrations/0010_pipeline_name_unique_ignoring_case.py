"""Served names are unique regardless of letter case. Pipelines deployed before this whose names differ only
in case stop the migration with their names, so that the operator deletes or renames one first."""

from typing import Any

import django.db.models.functions.text
from django.db import migrations, models


def refuse_names_that_differ_only_in_case(apps: Any, schema_editor: Any) -> None:
    Pipeline = apps.get_model("deployments", "Pipeline")
    seen: dict[str, str] = {}
    for name in Pipeline.objects.order_by("name").values_list("name", flat=True):
        if (other := seen.setdefault(name.lower(), name)) != name:
            raise RuntimeError(
                f"pipelines {other!r} and {name!r} serve names that differ only in letter case; delete one of "
                "them with the release before this one, then migrate again"
            )


class Migration(migrations.Migration):
    dependencies = [
        ("deployments", "0009_instance_incarnation"),
    ]

    operations = [
        migrations.RunPython(refuse_names_that_differ_only_in_case, migrations.RunPython.noop),
        migrations.AddConstraint(
            model_name="pipeline",
            constraint=models.UniqueConstraint(
                django.db.models.functions.text.Lower("name"), name="pipeline_name_unique_ignoring_case"
            ),
        ),
    ]
