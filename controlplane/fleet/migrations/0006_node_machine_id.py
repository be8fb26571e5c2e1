from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0005_rolling_updates"),
    ]

    operations = [
        migrations.AddField(
            model_name="node",
            name="machine_id",
            field=models.CharField(blank=True, max_length=128),
        ),
    ]
