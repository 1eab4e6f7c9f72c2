#!/usr/bin/env bash
# Run here (a machine with the package registries), before a GPU session: downloads into .whl/ (ignored by git)
# the wheels for Python 3.12 x86-64 that the GPU machine's image lacks for serving (fastapi, uvicorn, pyzmq and
# what they need beyond the image's own packages; fla-core for the glm5_next family's KDA kernel), pinned to the
# versions this project is tested with, and the tiny GLM checkpoints of the tests (transformers writes them here) under
# .whl/checkpoints. benchmarks/gpu_session.sh installs the wheels there when .whl/ travels (name .whl in the device
# call's carry) and runs the GLM kernel checks on the checkpoints.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 \
    typing-inspection==0.4.2 opentelemetry-api==1.45.2 uvicorn==0.55.0 pyzmq==27.3.0 \
    fla-core==0.6.0 einops==0.8.1
PYTHONPATH=tests${PYTHONPATH:+:$PYTHONPATH} python3 -c "
from test_glm5_next import random_glm5
from pathlib import Path
from test_glm_moe_dsa import random_glm, write_fp8_copy
random_glm5().save_pretrained('.whl/checkpoints/glm5')
random_glm().save_pretrained('.whl/checkpoints/glm')
write_fp8_copy(Path('.whl/checkpoints/glm'), Path('.whl/checkpoints/glm_fp8'))
# a servable FP8 GLM-5.2-family pair (byte tokenizer, random drafter) for gpu_serve_smoke.sh's --device cuda run
import json
from conftest import tiny_draft_config
from server_harness import CHAT_TEMPLATE
from draft_worker.draft_checkpoint import random_drafter, save_drafter
from shared.byte_tokenizer import END_OF_TEXT, write_byte_tokenizer
serve = Path('.whl/checkpoints/glm_serve')
random_glm(seed=5, vocab_size=258, eos_token_id=256, max_position_embeddings=2048).save_pretrained(serve / 'bf16')
write_fp8_copy(serve / 'bf16', serve / 'target')
write_byte_tokenizer(serve / 'target')
(serve / 'target' / 'tokenizer_config.json').write_text(json.dumps({'eos_token': END_OF_TEXT,
                                                                    'chat_template': CHAT_TEMPLATE}))
save_drafter(random_drafter(tiny_draft_config(target_layers=5, vocab=258, hidden=32, target_layer_ids=(1, 3),
                                              block_size=4), seed=3, std=0.2), serve / 'draft')"
ls .whl .whl/checkpoints
du -sh .whl
