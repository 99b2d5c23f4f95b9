"""Who may reach the studio, over real HTTP on 127.0.0.1: with --auth every route asks for the same
sign-in (Gradio's routes, the A1111 API, /metrics, file routes, /openapi.json), the login page does not
describe the API, wrong passwords are rate limited; in public mode a visitor reaches only the catalogue
and never a server path."""
from __future__ import annotations

import re

import httpx
import pytest

gradio_client = pytest.importorskip("gradio_client")
from gradio_client import Client  # noqa: E402

from core.settings import Settings  # noqa: E402
from tests.ui_helpers import SG_COND, SG_UNCOND, running_studio  # noqa: E402
from ui.access import LoginLimiter, redact_paths, share_warning, strip_api_info, visitor_abilities  # noqa: E402

USER, PASSWORD = "ana", "s3cret-pass"
OPEN = {"/", "/login", "/login/", "/favicon.ico", "/theme.css", "/gradio_api/theme.css", "/manifest.json",
        "/robots.txt", "/gradio_api/login_check", "/gradio_api/login_check/", "/gradio_api/app_id",
        "/gradio_api/app_id/", "/healthz", "/readyz", "/gradio_api/startup-events"}
OPEN_PREFIXES = ("/assets/", "/static/", "/svelte/", "/pwa_icon", "/gradio_api/static/", "/gradio_api/assets/")


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, testdata):
    with running_studio(tmp_path_factory.mktemp("guarded"), auth=(USER, PASSWORD)) as demo:
        yield demo


def every_route(demo) -> list[tuple[str, str]]:
    """(method, concrete path) for each route the server has, path parameters filled in."""
    out = []

    def walk(routes, prefix=""):
        for r in routes:
            if hasattr(r, "original_router"):          # an included APIRouter (Gradio's /gradio_api routes)
                walk(r.original_router.routes, prefix + (r.include_context.prefix or ""))
                continue
            path = getattr(r, "path", None)
            if not path:
                continue
            methods = sorted(getattr(r, "methods", None) or ["GET"])
            out.append(("GET" if "GET" in methods else methods[0], prefix + re.sub(r"\{[^}]+\}", "x", path)))
    walk(demo.app.routes)
    return sorted(set(out))


def login(base: str) -> httpx.Client:
    c = httpx.Client(base_url=base, timeout=30)
    r = c.post("/login", data={"username": USER, "password": PASSWORD})
    assert r.status_code == 200, r.text
    return c


def test_every_route_wants_the_sign_in(guarded):
    base = guarded.local_url.rstrip("/")
    routes = every_route(guarded)
    paths = {p for _m, p in routes}
    for must in ("/metrics", "/sdapi/v1/sd-models", "/openapi.json", "/gradio_api/openapi.json", "/config",
                 "/gradio_api/info", "/gradio_api/file=x", "/gradio_api/upload", "/gradio_api/queue/data"):
        assert must in paths, f"{must} is not a route any more: {sorted(paths)}"
    open_ones = []
    with httpx.Client(base_url=base, timeout=30) as anon:
        for method, path in routes:
            if path in OPEN or path.startswith(OPEN_PREFIXES) or path.startswith("/login"):
                continue
            r = anon.request(method, path)
            if r.status_code != 401:
                open_ones.append(f"{method} {path} -> {r.status_code}")
    assert not open_ones, "routes that answer without the sign-in:\n" + "\n".join(open_ones)
    # a file the studio really serves: refused without, served with the sign-in
    out = guarded.atelier_runtime.settings.output_dir
    f = out / "probe.png"
    f.write_bytes(b"\x89PNG\r\n\x1a\n")
    url = f"/gradio_api/file={f.resolve()}"
    assert httpx.get(base + url, timeout=30).status_code == 401
    assert httpx.get(base + url, auth=(USER, PASSWORD), timeout=30).status_code == 200


def test_the_sign_in_opens_every_kind_of_route(guarded):
    base = guarded.local_url.rstrip("/")
    for path in ("/metrics", "/sdapi/v1/sd-models", "/openapi.json", "/config", "/gradio_api/info"):
        r = httpx.get(base + path, auth=(USER, PASSWORD), timeout=30)
        assert r.status_code == 200, f"{path} -> {r.status_code} with HTTP Basic"
    with httpx.Client(base_url=base, timeout=30) as c:
        assert c.post("/login", data={"username": USER, "password": PASSWORD}).status_code == 200   # the browser's way: the login form's cookie
        for path in ("/metrics", "/config", "/gradio_api/info"):
            assert c.get(path).status_code == 200, path
    ok = Client(guarded.local_url, auth=(USER, PASSWORD), verbose=False)
    assert "named_endpoints" in ok.view_api(return_format="dict", print_info=False)


def test_the_login_page_does_not_describe_the_api(guarded):
    base = guarded.local_url.rstrip("/")
    page = httpx.get(base + "/", timeout=30)
    assert page.status_code == 200 and "auth_required" in page.text
    assert 'window.gradio_api_info = {"named_endpoints": {}, "unnamed_endpoints": {}}' in page.text
    for api_name in ("/generate", "/telemetry", "queue_job", "job_finished"):
        assert api_name not in page.text, f"the login page names {api_name}"
    with httpx.Client(base_url=base, timeout=30) as c:
        assert c.post("/login", data={"username": USER, "password": PASSWORD}).status_code == 200    # signed in, the page is whole again
        full = c.get("/").text
        assert "queue_job" in full and "auth_required" not in full


def test_wrong_passwords_are_rate_limited(guarded):
    base = guarded.local_url.rstrip("/")
    limiter: LoginLimiter = guarded.atelier_login_limiter
    now = [1000.0]
    limiter.clock = lambda: now[0]
    limiter.succeeded("127.0.0.1")
    try:
        codes = [httpx.post(base + "/login", data={"username": USER, "password": f"guess{i}"}, timeout=30).status_code
                 for i in range(limiter.max_failures)]
        assert set(codes) == {400}
        blocked = httpx.post(base + "/login", data={"username": USER, "password": PASSWORD}, timeout=30)
        assert blocked.status_code == 429 and int(blocked.headers["retry-after"]) >= 1
        # HTTP Basic is the same door: refused too, even with the right password
        assert httpx.get(base + "/metrics", auth=(USER, PASSWORD), timeout=30).status_code == 429
        now[0] += limiter.window_s + 1
        assert httpx.get(base + "/metrics", auth=(USER, PASSWORD), timeout=30).status_code == 200
        wrong_basic = [httpx.get(base + "/metrics", auth=(USER, "nope"), timeout=30).status_code
                       for _ in range(limiter.max_failures)]
        assert set(wrong_basic) == {401}
        assert httpx.post(base + "/login", data={"username": USER, "password": PASSWORD},
                          timeout=30).status_code == 429
    finally:
        limiter.succeeded("127.0.0.1")
        limiter.clock = LoginLimiter().clock


def test_strip_api_info_leaves_the_rest():
    page = (b"<script>window.gradio_config = {\"auth_required\": true};</script>"
            b"<script>window.gradio_api_info = {\"named_endpoints\": {\"/generate\": {}}};</script><body></body>")
    out = strip_api_info(page)
    assert b"/generate" not in out and b"gradio_config" in out and b"<body>" in out


# -- the share warning ---------------------------------------------------------------------------
def test_share_without_auth_warns_and_names_what_a_visitor_can_do():
    s = Settings(share=True)
    assert s.public
    text = share_warning(s)
    assert text and "--auth" in text and "anyone with the share link" in text
    assert "generate images" in text and "catalogue" in text
    assert "training" not in text and "download" not in text       # public mode: off unless allowed
    opened = share_warning(Settings(share=True, allow=frozenset({"train", "hub"}), data_dirs=("/data/art",)))
    assert "training run" in opened and "/data/art" in opened and "download" in opened
    assert share_warning(Settings(share=True, auth=("a", "b"))) is None
    assert share_warning(Settings()) is None                          # 127.0.0.1, local mode: nothing to warn
    local_share = share_warning(Settings(share=True, mode="local"))
    assert "file path" in local_share and "any folder" in local_share  # the host chose local mode: say it all
    assert len(visitor_abilities(Settings(mode="local"))) > len(visitor_abilities(Settings(share=True)))


def test_redact_paths():
    assert redact_paths("no StyleGAN model file at /srv/private/ffhq.pkl; give") == \
        "no StyleGAN model file at ffhq.pkl; give"
    assert "/home" not in redact_paths("read /home/me/.cache/x/model.bin failed")
    kept = "see https://huggingface.co/stabilityai/sd-turbo, size 512/768"
    assert redact_paths(kept) == kept


# -- public mode: a visitor reaches the catalogue, nothing else ----------------------------------------
@pytest.fixture(scope="module")
def public(tmp_path_factory, testdata):
    with running_studio(tmp_path_factory.mktemp("public"), mode="public") as demo:
        yield demo


def _error_text(excinfo) -> str:
    return str(excinfo.value)


def test_public_visitor_cannot_add_models_or_train(public):
    c = Client(public.local_url, verbose=False)
    names = set(c.view_api(return_format="dict", print_info=False)["named_endpoints"])
    assert "/generate" in names
    assert not {n for n in names if n.startswith("/train")}, "no training endpoints in public mode"
    with pytest.raises(Exception) as refused:
        c.predict("/etc/passwd", "stylegan", api_name="/add_model")
    assert "off on this public studio" in _error_text(refused)
    listed = c.predict("stylegan", None, api_name="/list_models")
    assert "passwd" not in str(public.config) and "passwd" not in str(listed)


def test_public_visitor_names_only_listed_models_and_sees_no_server_path(public, tmp_path):
    c = Client(public.local_url, verbose=False)
    unlisted = tmp_path / "secret-net.pkl"
    unlisted.write_bytes(SG_COND.read_bytes())          # a real model file the host did not list
    messages = []
    for ref in ("/etc/passwd", "/etc/no-such-file", str(unlisted)):
        with pytest.raises(Exception) as refused:
            c.predict(backend="stylegan", model=ref, seed="0", api_name="/generate")
        messages.append(_error_text(refused))
    for m in messages:
        assert "not available on this studio" in m
        assert str(tmp_path) not in m and "/etc/" not in m
        assert str(SG_UNCOND.parent) not in m, f"a server folder in a visitor's error: {m}"
    # no oracle: an existing file and a missing one read alike
    assert messages[0].replace("passwd", "X") == messages[1].replace("no-such-file", "X")
    gallery = c.predict(backend="stylegan", model=str(SG_UNCOND), seed="1", api_name="/generate")[0]
    assert len(gallery) == 1                            # what the catalogue lists still works


def test_public_visitors_added_models_stay_their_own(tmp_path, testdata):
    with running_studio(tmp_path, mode="public", allow=frozenset({"add-model"})) as demo:
        a, b = Client(demo.local_url, verbose=False), Client(demo.local_url, verbose=False)
        extra = tmp_path / "visitor-a.pkl"
        extra.write_bytes(SG_COND.read_bytes())
        picker, status = a.predict(str(extra), "stylegan", api_name="/add_model")
        assert "Added" in status
        assert str(extra) in str(a.predict("stylegan", None, api_name="/list_models"))
        assert str(extra) not in str(b.predict("stylegan", None, api_name="/list_models")), \
            "one visitor's model appeared in another visitor's list"
        assert "visitor-a" not in str(demo.config)


def test_local_mode_keeps_todays_freedom(tmp_path, testdata):
    with running_studio(tmp_path) as demo:
        assert demo.atelier_runtime.settings.mode == "local"
        c = Client(demo.local_url, verbose=False)
        extra = tmp_path / "mine.pkl"
        extra.write_bytes(SG_COND.read_bytes())
        assert "Added" in c.predict(str(extra), "stylegan", api_name="/add_model")[1]
        other = Client(demo.local_url, verbose=False)
        assert str(extra) in str(other.predict("stylegan", None, api_name="/list_models"))  # the operator's, for all
        assert "/train_start" in c.view_api(return_format="dict", print_info=False)["named_endpoints"]
