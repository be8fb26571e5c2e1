from django.contrib import admin

from controlplane.catalog.models import LanguageModel
from controlplane.readonly_admin import ReadOnlyAdmin

admin.site.register(LanguageModel, ReadOnlyAdmin)
