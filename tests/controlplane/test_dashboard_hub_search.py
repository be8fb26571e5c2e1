"""The Models page's "Find on Hugging Face": a search of a real (local) hub, a repo's size, context and memory
estimate against the fleet's free GPUs, and a sentence for every way the hub can fail, never a 500."""

import html
import json
import math
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
from django.test import Client

from controlplane.accounts.models import Role
from controlplane.catalog.memory import WEIGHTS_FACTOR
from controlplane.dashboard.hub_search import estimate_context
from controlplane.deployments.placement import format_bytes
from tests.agent.fake_hub import FakeHub, running_hub
from tests.controlplane.factories import make_model, make_node
from tests.controlplane.test_dashboard import logged_in

pytestmark = pytest.mark.django_db

# 80 layers × 8 KV heads × 128 dimensions × 2 bytes × 2 (keys, values): 320 KiB a token; 40 GiB at 128 Ki tokens.
BIG_CONFIG = {
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "hidden_size": 8192,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}
KV_BYTES = 80 * 8 * 128 * 2 * 2 * 131072
WEIGHTS = b"w" * 5000
GIB = 1024**3
CONFIG_BYTES = json.dumps(BIG_CONFIG).encode()


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """A hub on loopback that the control plane is pointed at, holding a safetensors repo and a GGUF repo."""
    with running_hub() as fake:
        fake.repos["org/Big-Model"] = {
            "config.json": CONFIG_BYTES,
            "tokenizer.json": b"{}",
            "model.safetensors": WEIGHTS,
            "pytorch_model.bin": b"b" * 7000,  # a second copy of the weights that a download skips
        }
        fake.cards["org/Big-Model"] = {
            "downloads": 1234,
            "likes": 56,
            "lastModified": "2026-03-01T10:00:00.000Z",
            "pipeline_tag": "text-generation",
            "tags": ["safetensors", "text-generation"],
        }
        fake.repos["org/Big-Model-GGUF"] = {"big-Q4_K_M.gguf": b"q" * 3000, "big-Q8_0.gguf": b"q" * 6000}
        fake.repos["org/Vision-GGUF"] = {
            "vision-Q4_K_M.gguf": b"v" * 3000,
            "mmproj-vision-Q8_0.gguf": b"p" * 500,
            "mmproj-vision-f16.gguf": b"p" * 900,
        }
        fake.cards["org/Big-Model-GGUF"] = {"tags": ["gguf"], "gguf": {"context_length": 32768}}
        point_at(monkeypatch, fake.url)
        yield fake


def point_at(monkeypatch: pytest.MonkeyPatch, endpoint: str, *, timeout_s: int = 5) -> None:
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", str(timeout_s))
    for name in ("HF_TOKEN", "HF_TOKEN_FILE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)


def search(client: Client, query: str) -> tuple[int, str]:
    response = client.get("/models/hub-search/", {"q": query})
    return response.status_code, html.unescape(response.content.decode())


def details(client: Client, **params: str) -> tuple[int, str]:
    response = client.get("/models/hub-details/", params)
    return response.status_code, html.unescape(response.content.decode())


def row(page: str, engine: str) -> str:
    """The fits table's row of ``engine``."""
    return page.split(f'data-engine="{engine}"')[1].split("</tr>")[0]


# -- search ---------------------------------------------------------------------------------------


def test_a_search_lists_the_matching_repos_with_downloads_likes_date_task_and_weight_formats(hub: FakeHub) -> None:
    status, page = search(logged_in(Role.OPERATOR), "big-model")
    assert status == 200
    assert "org/Big-Model" in page and "org/Big-Model-GGUF" in page
    assert "1234" in page and "56" in page and "2026-03-01" in page and "text-generation" in page
    assert "safetensors" in page and "GGUF" in page
    assert "repo=org/Big-Model-GGUF" in page  # the Details button of each repo


def test_the_search_asks_the_hub_as_list_models_does(hub: FakeHub) -> None:
    search(logged_in(Role.OPERATOR), "  smol ")
    [query] = hub.searches
    asked = parse_qs(query)
    assert asked["search"] == ["smol"] and asked["limit"] == ["20"] and asked["full"] == ["true"]


def test_a_search_that_matches_nothing_says_so(hub: FakeHub) -> None:
    status, page = search(logged_in(Role.OPERATOR), "nothing-like-it")
    assert status == 200 and "No repo on the hub matches" in page


@pytest.mark.parametrize("query", ["", "   ", "x" * 101])
def test_an_empty_or_too_long_query_is_a_form_error(hub: FakeHub, query: str) -> None:
    status, page = search(logged_in(Role.OPERATOR), query)
    assert status == 400 and 'class="error"' in page
    assert hub.searches == []


def test_read_only_people_may_search_since_it_reads_public_data_only(hub: FakeHub) -> None:
    status, page = search(logged_in(Role.READ_ONLY), "big")
    assert status == 200 and "org/Big-Model" in page


def test_people_who_are_not_logged_in_are_sent_to_the_login_page(hub: FakeHub) -> None:
    response = Client().get("/models/hub-search/", {"q": "big"})
    assert response.status_code == 302 and "/login/" in response["Location"]
    assert hub.searches == []


def test_an_unreachable_hub_is_a_sentence_naming_it_and_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    point_at(monkeypatch, f"http://127.0.0.1:{port}")  # nothing listens there: connections are refused
    status, page = search(logged_in(Role.OPERATOR), "big")
    assert status == 200
    assert f"cannot reach the Hugging Face hub at http://127.0.0.1:{port}" in page
    assert "HF_ENDPOINT" in page and "local folder" in page


def test_a_hub_that_does_not_answer_in_time_is_a_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as silent:  # accepts connections (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        point_at(monkeypatch, f"http://127.0.0.1:{silent.getsockname()[1]}", timeout_s=1)
        status, page = search(logged_in(Role.OPERATOR), "big")
    assert status == 200 and "did not answer" in page and "HF_ENDPOINT" in page


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        ((200, b"<html>a login page</html>"), "is not JSON"),
        ((200, b'{"models": []}'), "not a list"),
        ((500, b"{}"), "failed on the search"),
        ((401, b"{}"), "set HF_TOKEN"),
    ],
)
def test_a_broken_search_answer_is_a_sentence(hub: FakeHub, answer: tuple[int, bytes], words: str) -> None:
    hub.answers["/api/models"] = answer
    status, page = search(logged_in(Role.OPERATOR), "big")
    assert status == 200 and words in page and hub.url in page


def test_a_bad_hub_setting_is_a_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    point_at(monkeypatch, "http://127.0.0.1:1")
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "soon")
    status, page = search(logged_in(Role.OPERATOR), "big")
    assert status == 200 and "HF_HUB_ETAG_TIMEOUT" in page


# -- a repo's details ----------------------------------------------------------------------------------


def test_the_details_give_the_downloaded_size_the_context_the_kv_shape_and_the_estimate(hub: FakeHub) -> None:
    make_node("gpu-a", (80, 80))
    status, page = details(logged_in(Role.OPERATOR), repo="org/Big-Model")
    assert status == 200
    # config.json, tokenizer.json and the safetensors: not the .bin a download skips.
    size = len(CONFIG_BYTES) + 2 + len(WEIGHTS)
    assert f"<dd>{format_bytes(size)}</dd>" in page
    assert "131072 tokens" in page
    assert "320 KiB per token (80 layers × 8 KV heads × 128 dimensions" in page
    need = math.ceil(size * WEIGHTS_FACTOR) + KV_BYTES
    assert f'<dd>{format_bytes(need)} <span class="hint">(weights × 1.2' in page
    assert "<dt>Projector</dt>" not in page


def test_the_details_say_which_gpus_it_fits_on_for_each_engine(hub: FakeHub) -> None:
    make_node("gpu-a", (80, 80))
    make_node("gpu-b", (24, 24), memory_gib=16)
    _, page = details(logged_in(Role.OPERATOR), repo="org/Big-Model")
    mistral = row(page, "mistralrs")
    assert "gpu-a GPU 0: 80 GiB free; gpu-a GPU 1: 80 GiB free" in mistral
    assert "gpu-b GPU" not in mistral  # 24 GiB each: a 40 GiB replica does not fit one
    assert "on CPU: gpu-a: 64 GiB free" in mistral and "gpu-b:" not in mistral
    # No factory node runs vLLM: the row says how to get one.
    assert "fits nowhere" in row(page, "vllm") and "no node runs vllm" in row(page, "vllm")
    assert "llamacpp" not in page  # llama.cpp loads GGUF files only


def test_a_model_too_big_for_one_gpu_fits_on_several_of_one_node(hub: FakeHub) -> None:
    make_node("gpu-b", (24, 24), memory_gib=16)
    _, page = details(logged_in(Role.OPERATOR), repo="org/Big-Model")
    assert "2 GPUs of gpu-b (0, 1)" in row(page, "mistralrs")


def test_a_model_that_fits_nowhere_says_why(hub: FakeHub) -> None:
    make_node("small", (16,), memory_gib=16)
    _, page = details(logged_in(Role.OPERATOR), repo="org/Big-Model")
    mistral = row(page, "mistralrs")
    assert "fits nowhere: on GPUs: needs 1 GPU with" in mistral and "the best node, small, has 0" in mistral
    assert "on CPU: needs a node with" in mistral


def test_a_repo_of_several_gguf_files_asks_for_one_and_then_gives_its_details(hub: FakeHub) -> None:
    make_node("gpu-a", (80,))
    client = logged_in(Role.OPERATOR)
    status, page = details(client, repo="org/Big-Model-GGUF")
    assert status == 200 and "holds 2 GGUF files" in page and "file=big-Q8_0.gguf" in page
    _, page = details(client, repo="org/Big-Model-GGUF", file="big-Q8_0.gguf")
    assert "big-Q8_0.gguf" in page and "5.9 KiB" in page  # that file alone
    assert "32768 tokens" in page  # the hub's GGUF metadata; no config.json, so no KV shape
    assert "unknown: no config.json" in page
    assert "gpu-a GPU 0" in row(page, "llamacpp") and "vllm" not in page


def test_the_add_link_fills_the_add_model_form(hub: FakeHub) -> None:
    make_node("gpu-a", (80,))
    client = logged_in(Role.OPERATOR)
    _, page = details(client, repo="org/Big-Model-GGUF", file="big-Q8_0.gguf")
    link = page.split('id="hub-add" class="button" href="')[1].split('"')[0]
    values = parse_qs(urlparse(link).query)
    assert values["source"] == ["org/Big-Model-GGUF"] and values["filename"] == ["big-Q8_0.gguf"]
    assert values["engine"] == ["llamacpp"] and values["name"] == ["Big-Model-GGUF"]
    form = client.get(link.split("#")[0]).content.decode()
    assert 'value="org/Big-Model-GGUF"' in form and 'value="big-Q8_0.gguf"' in form and 'value="Big-Model-GGUF"' in form


def test_a_vision_repos_projector_is_shown_and_named_in_the_add_model_form_for_llamacpp(hub: FakeHub) -> None:
    make_node("gpu-a", (80,))
    client = logged_in(Role.OPERATOR)
    _, page = details(client, repo="org/Vision-GGUF", file="vision-Q4_K_M.gguf")
    assert "mmproj-vision-Q8_0.gguf, mmproj-vision-f16.gguf" in page  # both listed, f16 chosen
    assert "the Add-model form names mmproj-vision-f16.gguf" in page
    # llama.cpp loads the projector beside the weights: the estimate counts the one the form names (900 bytes).
    assert f"<dt>Projector</dt><dd>{format_bytes(900)} <span" in page
    need = format_bytes(math.ceil((3000 + 900) * WEIGHTS_FACTOR))
    assert f'<dd>{need} <span class="hint">((weights + projector) × 1.2' in page
    link = page.split('id="hub-add" class="button" href="')[1].split('"')[0]
    values = parse_qs(urlparse(link).query)
    assert values["engine"] == ["llamacpp"] and values["projector"] == ["mmproj-vision-f16.gguf"]
    form = client.get(link.split("#")[0]).content.decode()
    assert 'value="mmproj-vision-f16.gguf"' in form
    # A repo without one names none.
    _, plain = details(client, repo="org/Big-Model-GGUF", file="big-Q8_0.gguf")
    assert "hub-projectors" not in plain and "projector=" not in plain


def test_a_projector_counts_in_llamacpps_need_only() -> None:
    make_node("gpu-a", (80,))
    weights, projector = 60 * GIB, 10 * GIB  # x 1.2: 72 GiB fit one 80 GiB GPU, 84 GiB do not
    context = estimate_context(weights, {}, None, ["llamacpp", "mistralrs"], projector_bytes=projector)
    fits = {fit.engine: fit for fit in context["fits"]}
    assert fits["llamacpp"].memory_bytes == math.ceil(70 * GIB * WEIGHTS_FACTOR)
    assert fits["mistralrs"].memory_bytes == context["need"] == math.ceil(60 * GIB * WEIGHTS_FACTOR)
    assert fits["mistralrs"].gpus == ["gpu-a GPU 0: 80 GiB free"]
    assert fits["llamacpp"].gpus == []  # 84 GiB: not on the 80 GiB GPU
    assert context["projector_bytes"] == projector


def test_read_only_people_see_the_details_but_no_add_link(hub: FakeHub) -> None:
    status, page = details(logged_in(Role.READ_ONLY), repo="org/Big-Model")
    assert status == 200 and "131072 tokens" in page and "hub-add" not in page


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"repo": "org/No-Such-Model"}, "has no repo 'org/No-Such-Model' (404)"),
        ({"repo": "org/Big-Model-GGUF", "file": "big-Q2.gguf"}, "has no file 'big-Q2.gguf'"),
    ],
)
def test_a_missing_repo_or_file_is_a_sentence(hub: FakeHub, params: dict[str, str], words: str) -> None:
    status, page = details(logged_in(Role.OPERATOR), **params)
    assert status == 200 and words in page


def test_a_malformed_repo_answer_is_a_sentence(hub: FakeHub) -> None:
    client = logged_in(Role.OPERATOR)
    hub.answers["/api/models/org/Big-Model"] = (200, b"not json")
    status, page = details(client, repo="org/Big-Model")
    assert status == 200 and "is not JSON" in page
    hub.answers["/api/models/org/Big-Model"] = (200, b'{"id": "org/Big-Model"}')
    status, page = details(client, repo="org/Big-Model")
    assert status == 200 and "lists no files" in page


def test_a_malformed_config_leaves_the_kv_part_out(hub: FakeHub) -> None:
    hub.repos["org/Big-Model"]["config.json"] = b"{not json"
    status, page = details(logged_in(Role.OPERATOR), repo="org/Big-Model")
    assert status == 200 and "unknown: no config.json" in page


@pytest.mark.parametrize(
    "params",
    [{}, {"repo": "not a repo"}, {"repo": "org/x", "revision": "../etc"}, {"repo": "org/x", "file": "config.json"}],
)
def test_a_bad_repo_id_is_a_form_error(hub: FakeHub, params: dict[str, str]) -> None:
    status, page = details(logged_in(Role.OPERATOR), **params)
    assert status == 400 and 'class="error"' in page


def test_the_details_of_an_unreachable_hub_are_a_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    point_at(monkeypatch, "http://127.0.0.1:1")
    status, page = details(logged_in(Role.OPERATOR), repo="org/Big-Model")
    assert status == 200 and "cannot reach the Hugging Face hub at http://127.0.0.1:1" in page


# -- a model of the catalog ------------------------------------------------------------------------


def test_a_catalog_models_page_shows_its_size_context_estimate_and_where_it_fits() -> None:
    make_node("gpu-a", (80,))
    model = make_model("big", engine="mistralrs", size_bytes=5000, config=BIG_CONFIG)
    page = logged_in(Role.READ_ONLY).get(f"/models/{model.pk}/").content.decode()
    assert "131072 tokens" in page and "4.9 KiB" in page and "320 KiB per token" in page
    assert "gpu-a GPU 0: 80 GiB free" in row(page, "mistralrs")


def test_a_catalog_models_projector_is_shown_beside_its_size_and_counted_in_its_need(tmp_path: Path) -> None:
    gguf, projector = tmp_path / "v.gguf", tmp_path / "mmproj.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 2044)
    projector.write_bytes(b"GGUF" + b"\0" * 1020)
    model = make_model("v", source_kind="gguf", source=str(gguf), engine="llamacpp", projector=str(projector))
    client = logged_in(Role.READ_ONLY)
    page = client.get(f"/models/{model.pk}/").content.decode()
    assert f"<dt>Projector</dt><dd>{format_bytes(1024)} <span" in page
    need = format_bytes(math.ceil(3072 * WEIGHTS_FACTOR))  # (2 KiB + 1 KiB) x 1.2
    assert f'<dd>{need} <span class="hint">((weights + projector) × 1.2' in page
    plain = make_model("plain", source_kind="gguf", source=str(gguf), engine="llamacpp")
    assert "<dt>Projector</dt>" not in client.get(f"/models/{plain.pk}/").content.decode()


def test_a_weightless_catalog_model_shows_no_estimate() -> None:
    model = make_model("sim", engine="mocker", size_bytes=5000)
    page = logged_in(Role.OPERATOR).get(f"/models/{model.pk}/").content.decode()
    assert "Its engine loads no weights" in page


def test_the_query_is_sent_encoded(hub: FakeHub) -> None:
    search(logged_in(Role.OPERATOR), "a&b=c")
    assert parse_qs(hub.searches[0])["search"] == ["a&b=c"]


def test_the_models_page_has_the_search_box_for_every_role() -> None:
    page = logged_in(Role.READ_ONLY).get("/models/").content.decode()
    assert 'hx-get="/models/hub-search/"' in page and 'id="hub-details"' in page
