"""The agent's reports are defined once (runtime/fleet_contract/reports.py); the API's serializers, which check them
against the control plane's limits and describe them in the OpenAPI schema, agree with them field for field,
and what the agent encodes is read back as the same report."""

import json
import types
from typing import Any, Union, get_args, get_origin

import msgspec
import pytest
from rest_framework import serializers
from rest_framework.fields import empty

from controlplane.api.fields import LabelsField
from controlplane.fleet.api.serializers import (
    DownloadReportSerializer,
    GpuReportSerializer,
    InstanceReportSerializer,
    NodeRegistrationSerializer,
    NodeReportSerializer,
)
from runtime.fleet_contract.reports import DownloadReport, GpuReport, InstanceReport, NodeReport
from tests.controlplane.factories import make_model

# (serializer, report, fields the serializer has beside the report's, fields it requires though the report
# has a default)
PAIRS: list[tuple[type[serializers.Serializer], type[msgspec.Struct], set[str], set[str]]] = [
    (GpuReportSerializer, GpuReport, set(), set()),
    (NodeReportSerializer, NodeReport, set(), set()),
    (NodeRegistrationSerializer, NodeReport, set(), {"name"}),  # a registration says whose node it is
    (InstanceReportSerializer, InstanceReport, set(), set()),
    (DownloadReportSerializer, DownloadReport, {"model"}, set()),  # the model is sent beside the report
]
# The serializer fields that hold each type of a report's field.
FIELD_TYPES: dict[Any, tuple[type[serializers.Field], ...]] = {
    int: (serializers.IntegerField,),
    float: (serializers.FloatField,),
    bool: (serializers.BooleanField,),
    str: (serializers.CharField, serializers.ChoiceField),
    dict[str, str]: (LabelsField,),
    list[str]: (serializers.ListField,),
}


def _not_none(annotation: Any) -> Any:
    """``int`` of ``int | None``."""
    if get_origin(annotation) in (Union, types.UnionType):
        (kept,) = [arg for arg in get_args(annotation) if arg is not type(None)]
        return kept
    return annotation


@pytest.mark.parametrize(
    ("serializer_class", "report", "extra", "required_here"), PAIRS, ids=[pair[0].__name__ for pair in PAIRS]
)
def test_each_serializer_has_its_reports_fields_and_defaults(
    serializer_class: type[serializers.Serializer],
    report: type[msgspec.Struct],
    extra: set[str],
    required_here: set[str],
) -> None:
    fields = serializer_class().fields
    assert set(fields) - extra == {field.name for field in msgspec.structs.fields(report)}
    for info in msgspec.structs.fields(report):
        field = fields[info.name]
        kind = _not_none(info.type)
        if get_origin(kind) is list and issubclass(get_args(kind)[0], msgspec.Struct):
            assert isinstance(field, serializers.ListSerializer), info.name  # a list of nested reports
        else:
            assert isinstance(field, FIELD_TYPES[kind]), (info.name, type(field).__name__)
        assert field.required == (info.required or info.name in required_here), info.name
        if field.required:
            continue
        default = info.default_factory() if info.default is msgspec.NODEFAULT else info.default
        if field.default is empty:  # left out, the field is not in validated_data: the report's default holds
            assert default in (None, ""), f"{info.name}: left out means 'not said', a default of None or ''"
        else:
            assert (field.default() if callable(field.default) else field.default) == default, info.name


FULL_NODE = NodeReport(
    name="gpu-a",
    address="10.0.0.5",
    labels={"zone": "east"},
    cpu_count=32,
    memory_total_bytes=256 << 30,
    memory_available_bytes=200 << 30,
    agent_version="0.1.0",
    gpus=[
        GpuReport(
            index=0,
            name="NVIDIA H100",
            uuid="GPU-5d2b7f3e",
            memory_total_bytes=80 << 30,
            memory_used_bytes=1 << 30,
            utilization_percent=40,
        ),
        GpuReport(index=1, memory_total_bytes=80 << 30),
    ],
    machine_id="3d1219c7c4c5404aaa1f6d2a48adfda4",
    engines=["llamacpp", "mocker"],
    cpu_utilization_percent=37.5,
)


def _sent(report: msgspec.Struct, **beside: Any) -> Any:
    """The body the agent sends for ``report``, as the API's JSON parser gives it to a serializer."""
    return {**beside, **json.loads(msgspec.json.encode(report))}


@pytest.mark.parametrize(
    ("serializer_class", "report"),
    [
        (NodeRegistrationSerializer, FULL_NODE),
        (NodeRegistrationSerializer, NodeReport(name="gpu-a")),
        (NodeReportSerializer, NodeReport()),
        (NodeReportSerializer, NodeReport(engines=[])),
        (InstanceReportSerializer, InstanceReport(state="downloading")),
        (
            InstanceReportSerializer,
            InstanceReport(
                state="failed",
                reason="exit code 2",
                pid=4242,
                endpoint_instance_id=0xABC,
                download_progress=0.5,
                attempt=3,
                permanent=True,
            ),
        ),
    ],
    ids=repr,
)
def test_what_the_agent_sends_is_read_back_as_the_same_report(
    serializer_class: type[serializers.Serializer], report: msgspec.Struct
) -> None:
    serializer = serializer_class(data=_sent(report))
    assert serializer.is_valid(), serializer.errors
    assert serializer.to_report() == report  # type: ignore[attr-defined]


@pytest.mark.django_db
@pytest.mark.parametrize(
    "report",
    [DownloadReport(state="pending"), DownloadReport(state="failed", bytes_done=5, bytes_total=10, error="disk full")],
    ids=repr,
)
def test_a_download_report_is_read_back_with_its_model_beside_it(report: DownloadReport) -> None:
    serializer = DownloadReportSerializer(data=_sent(report, model=make_model().pk))
    assert serializer.is_valid(), serializer.errors
    assert serializer.to_report() == report
