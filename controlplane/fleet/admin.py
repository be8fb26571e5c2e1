from django.contrib import admin

from controlplane.fleet.models import Download, Gpu, Node
from controlplane.readonly_admin import ReadOnlyAdmin

admin.site.register(Download, ReadOnlyAdmin)
admin.site.register(Gpu, ReadOnlyAdmin)
admin.site.register(Node, ReadOnlyAdmin)
