"""/openapi.json against the live server: a valid OpenAPI document whose every route lists each request field it
takes, and each status and media type it was seen to answer with here (the error bodies valid against their
schemas); /docs renders it; `serve --served-model-name` sets the names /v1/models lists."""

from __future__ import annotations

import re

import pytest

httpx = pytest.importorskip("httpx")
validator = pytest.importorskip("openapi_spec_validator")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("av")

from music3serve import cli
from music3serve.serving.engine import Engine
from music3serve.serving import music_generation, openai_speech
from music3serve.serving.music_generation import AudioSetting, MusicBody
from music3serve.serving.openai_speech import SpeechBody
from music3serve.serving.body_limits import MAX_BODY_BYTES
from music3serve.serving.request_body import SongBody

TINY = {"seed": 1, "steps": 1}
SONG = {"caption": "pop", "lyrics": "[verse]\nla", "duration": 0.04, **TINY}
SPEECH = {"model": "MiniMax-Music3", "input": "[verse]\nla", "instructions": "pop", "max_new_tokens": 1, **TINY}
MUSIC = {"model": "MiniMax-Music3", "prompt": "pop", "lyrics": "[verse]\nla", "max_new_tokens": 1, **TINY}
REFUSED_FIELDS = {SpeechBody: openai_speech.REFUSED, MusicBody: music_generation.REFUSED}


@pytest.fixture(scope="module")
def schema(base_url: str) -> dict:
    return httpx.get(f"{base_url}/openapi.json").json()


def test_the_schema_is_valid_openapi_with_one_operation_id_each(schema):
    validator.validate(schema)
    ids = [op["operationId"] for path in schema["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids)) and "422" not in str(list(schema["paths"].values()))


@pytest.mark.parametrize(("path", "model"), [("/v1/songs", SongBody), ("/v1/audio/speech", SpeechBody),
                                             ("/v1/music_generation", MusicBody)])
def test_every_request_field_is_in_the_schema(schema, path, model):
    ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    components = schema["components"]["schemas"]
    body = components[ref.rsplit("/", 1)[1]]
    refused = set(REFUSED_FIELDS.get(model, {}))  # taken only to be refused: left out, named in the description
    assert set(body["properties"]) == set(model.model_fields) - refused and body["additionalProperties"] is False
    assert all(name in body["description"] for name in refused)
    if model is MusicBody:
        assert set(components["AudioSetting"]["properties"]) == set(AudioSetting.model_fields)


SEEDS = (0, 2**64 - 1, 2**64, -1)
# (path, body) pairs: the schema must take those the server takes and refuse those it refuses.
BODIES = [(path, {**body, "seed": seed}) for path, body in (("/v1/songs", SONG), ("/v1/audio/speech", SPEECH),
                                                            ("/v1/music_generation", MUSIC)) for seed in SEEDS]
BODIES += [("/v1/audio/speech", {**SPEECH, field: value}) for field, value in (
    ("temperature", 0.7), ("top_p", 0.9), ("top_k", 50), ("repetition_penalty", 1.1), ("ref_audio", "a.wav"),
    ("speed", 1.0), ("speed", 1.5), ("speed", 0.5))]
BODIES += [("/v1/music_generation", {**MUSIC, field: value}) for field, value in (
    ("audio_url", "https://a.example/a.mp3"), ("refer_voice", "v"), ("output_format", "url"),
    ("output_format", "hex"), ("lyrics_optimizer", True), ("lyrics_optimizer", False), ("aigc_watermark", True))]
BODIES += [("/v1/songs", {**SONG, "steps": 0}), ("/v1/songs", {**SONG, "temperature": 1.0})]
BODIES += [("/v1/audio/speech", {**SPEECH, "voice": voice}) for voice in ("", "alloy")]
BODIES += [("/v1/songs", {**SONG, "caption": "a" * 5001}), ("/v1/audio/speech", {**SPEECH, "input": "a" * 20001}),
           ("/v1/music_generation", {**MUSIC, "prompt": "a" * 5001})]


@pytest.mark.parametrize(("path", "body"), BODIES, ids=[f"{p}-{sorted(set(b) - set(SONG) - set(SPEECH) - set(MUSIC))}-"
                                                        f"{b.get('seed')}" for p, b in BODIES])
def test_the_schema_takes_what_the_server_takes(schema, client, path, body):
    """A validator (or an SDK generated from the schema) accepts these bodies exactly when the server does: refused
    fields and values are not in it, the seed's bound is the integer 2**64 - 1, the voice and lengths are bounded."""
    ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    valid = jsonschema.Draft202012Validator({"$ref": ref, "components": schema["components"]}).is_valid(body)
    response = client.post(path, json={**body, "stream": False})
    assert (response.status_code == 200) is valid, response.text[:200]
    if not valid:
        assert response.status_code == 400


def requests_seen(client: httpx.Client, engine: Engine) -> list[tuple[str, str, httpx.Response]]:
    """(method, path in the schema, response) for each way a route answers that a test can reach."""
    seen = []

    def send(method: str, path: str, route: str | None = None, **kwargs) -> httpx.Response:
        response = client.request(method, path, **kwargs)
        seen.append((method.lower(), route or path, response))
        return response

    for stream in (False, True):
        for format in ("wav", "mp3", "flac", "opus", "aac", "pcm"):
            song = send("POST", "/v1/songs", json={**SONG, "format": format, "stream": stream})
            send("POST", "/v1/audio/speech", json={**SPEECH, "response_format": format, "stream": stream})
        for format in ("mp3", "wav", "pcm"):
            send("POST", "/v1/music_generation", json={**MUSIC, "stream": stream, "audio_setting": {"format": format}})
    send("POST", "/v1/audio/speech", json={**SPEECH, "stream_format": "sse"})
    for path, body in (("/v1/songs", SONG), ("/v1/audio/speech", SPEECH), ("/v1/music_generation", MUSIC)):
        send("POST", path, json={**body, "seed": -1})
        if path != "/v1/songs":
            send("POST", path, json={**body, "model": "elsewhere"})
        send("POST", path, content=iter([b"{}"]), headers={"content-type": "application/json"})  # chunked: 411
        send("POST", path, content=b" " * (MAX_BODY_BYTES + 1), headers={"content-type": "application/json"})
        engine.max_songs, held = 0, engine.max_songs
        try:
            send("POST", path, json=body)
        finally:
            engine.max_songs = held
    send("GET", f"/v1/songs/{song.headers['x-song-id']}", "/v1/songs/{song_id}")
    send("GET", "/v1/songs/unknown", "/v1/songs/{song_id}")
    send("DELETE", "/v1/songs/unknown", "/v1/songs/{song_id}")
    for method in ("GET", "HEAD"):
        send(method, "/health")
    send("GET", "/metrics")
    send("GET", "/v1/models")
    for model in ("MiniMaxAI/MiniMax-Music3", "elsewhere"):
        send("GET", f"/v1/models/{model}", "/v1/models/{model}")
    return seen


def test_every_status_and_media_type_a_route_answers_with_is_in_the_schema(schema, client, engine):
    statuses = set()
    for method, path, response in requests_seen(client, engine):
        documented = schema["paths"][path][method]["responses"]
        where = f"{method} {path} {response.status_code}"
        assert str(response.status_code) in documented, where
        statuses.add(response.status_code)
        content = documented[str(response.status_code)].get("content", {})
        media = response.headers.get("content-type", "").split(";")[0]
        assert media in {key.split(";")[0] for key in content} or (not content and not response.content), where
        if response.status_code >= 400 and method != "head":
            jsonschema.validate(response.json(), content["application/json"]["schema"])
        declared = {name.lower() for name in documented[str(response.status_code)].get("headers", {})}
        assert not {"retry-after", "www-authenticate"} & set(response.headers) - declared, where
    assert statuses == {200, 204, 400, 404, 411, 413, 429}


def test_401_and_the_host_checks_400_are_listed_where_the_server_may_send_them(engine):
    """A server without keys sends no 401, and one answering any Host no Host refusal: their schema lists neither
    (a generated client would expect them). With keys and a loopback bind, every /v1/ route lists both, and the Host
    check's 400 is on every route but /health and /metrics."""
    from music3serve.serving.access import Access, HostPolicy
    from music3serve.serving.api import create_app

    def statuses(access: Access) -> dict[str, set[str]]:
        paths = create_app(engine, access=access).openapi()["paths"]
        return {f"{method} {path}": set(op["responses"]) for path, ops in paths.items() for method, op in ops.items()}

    open_server = statuses(Access())
    assert not any("401" in codes for codes in open_server.values())
    assert "400" not in open_server["get /v1/models"] and "400" in open_server["post /v1/songs"]
    guarded = statuses(Access(api_keys=("key",), hosts=HostPolicy.for_bind("127.0.0.1")))
    for operation, codes in guarded.items():
        assert ("401" in codes) == (" /v1/" in operation), operation
        assert ("400" in codes) == (operation.split()[1] not in ("/health", "/metrics")), operation


def test_docs_render_the_schema_from_files_served_here(client):
    """Swagger UI's script, style sheet and icon come from the fastapi-offline package, served under /docs/assets."""
    response = client.get("/docs")
    assert response.status_code == 200 and "url: '/openapi.json'" in response.text
    assets = re.findall(r'(?:src|href)="([^"]+)"', response.text)
    names = ("favicon.png", "swagger-ui-bundle.js", "swagger-ui.css")
    assert sorted(assets) == [f"/docs/assets/{name}" for name in names]
    for asset in assets:
        assert client.get(asset).status_code == 200 and len(client.get(asset).content) > 1000, asset


def test_docs_load_swagger_ui_from_a_cdn_without_fastapi_offline(monkeypatch):
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from music3serve.serving import openapi_docs
    from music3serve.serving.api import create_app

    monkeypatch.setattr(openapi_docs, "swagger_ui_files", lambda: None)
    client = TestClient(create_app(SimpleNamespace(max_songs=1)), base_url="http://localhost")
    page = client.get("/docs").text
    assert "url: '/openapi.json'" in page and re.search(r'src="https://[^"]+/swagger-ui-bundle\.js"', page)
    assert client.get("/docs/assets/swagger-ui.css").status_code == 404


def test_serve_takes_the_model_names_to_serve(monkeypatch, tmp_path, root_logger):
    from fastapi.testclient import TestClient

    from music3serve.serving.server import ForceQuitServer

    class FakeEngine:
        max_songs = 1024

        def close(self):
            pass

    calls = {}
    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(lambda *args, **kwargs: FakeEngine()))
    monkeypatch.setattr(ForceQuitServer, "run", lambda self, sockets=None: calls.update(vars(self.config)))
    argv = ["serve", "--model", str(tmp_path), "--device", "cpu", "--served-model-name", "music-2.6",
            "--served-model-name", "mine"]
    assert cli.main(argv) == 0
    with TestClient(calls["app"], base_url="http://localhost") as client:  # serve --host 127.0.0.1: loopback names
        assert [model["id"] for model in client.get("/v1/models").json()["data"]] == ["music-2.6", "mine"]
        response = client.post("/v1/audio/speech", json={**SPEECH, "model": "MiniMax-Music3"})
        assert response.status_code == 404 and "music-2.6, mine" in response.json()["error"]["message"]


def test_the_docs_page_lists_every_operation_offline(browser, base_url, schema):
    """In Chromium with every request off this server refused: the page renders, one block per operation."""
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(base_url) else route.abort())
    page.goto(f"{base_url}/docs")
    operations = sum(len(methods) for methods in schema["paths"].values())
    page.wait_for_function(f"() => document.querySelectorAll('.opblock').length === {operations}", timeout=30_000)
    assert "music3serve" in page.inner_text(".info .title") and errors == [], errors
    page.close()
