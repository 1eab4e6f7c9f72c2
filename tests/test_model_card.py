"""A drafter's license as its model card or config names it (the GLM-5.3-Flash DFlash 2 drafter is published
under CC BY-NC-ND 4.0: an operator must see it), shown in /v1/models beside vLLM's model fields."""

import asyncio
import json

from fastapi.testclient import TestClient

from gateway.app import GatewaySettings, create_app
from gateway.tokenization import TextCodec
from shared.demo_models import DEMO_DIR
from shared.model_card import model_license


def test_the_license_comes_from_the_card_then_the_config(tmp_path):
    assert model_license(None) is None and model_license(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"license": "apache-2.0"}))
    assert model_license(tmp_path) == "apache-2.0"
    (tmp_path / "README.md").write_text("---\nlicense: cc-by-nc-nd-4.0\nbase_model: x\n---\n# A drafter\n")
    assert model_license(tmp_path) == "cc-by-nc-nd-4.0"
    (tmp_path / "README.md").write_text("---\nlicense: other\nlicense_name: 'glm-license'\n---\n")
    assert model_license(tmp_path) == "glm-license"
    (tmp_path / "README.md").write_text("# no front matter\nlicense: mit\n")
    assert model_license(tmp_path) == "apache-2.0"


def test_v1_models_shows_it():
    settings = GatewaySettings("m", 4096, 1024, "tcp://127.0.0.1:9", "tcp://127.0.0.1:9", dead_after_s=600,
                               drafter_license="cc-by-nc-nd-4.0")
    app = create_app(settings, TextCodec.from_folder(DEMO_DIR / "target"))
    try:
        model = TestClient(app).get("/v1/models").json()["data"][0]
        assert model["drafter"]["license"] == "cc-by-nc-nd-4.0" and model["max_model_len"] == 1024
        assert {k: model[k] for k in ("id", "object", "owned_by", "root", "parent")} == {  # vLLM's fields
            "id": "m", "object": "model", "owned_by": "dflash-serve", "root": "m", "parent": None}
    finally:
        asyncio.run(app.state.client.close())
