from django.contrib import admin

from controlplane.deployments.models import Instance, Pipeline, WorkerGroup
from controlplane.readonly_admin import ReadOnlyAdmin

admin.site.register(Instance, ReadOnlyAdmin)
admin.site.register(Pipeline, ReadOnlyAdmin)
admin.site.register(WorkerGroup, ReadOnlyAdmin)
