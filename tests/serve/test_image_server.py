"""``hfaccel serve`` on an image-text-to-text model (a tiny LLaVA over SmolLM2's tokenizer, its real processor): chat
requests with OpenAI ``image_url`` parts (``data:`` URLs) through the ``openai`` client, streamed and not, give the
Engine's tokens for the same prompt — on one process and over two tensor-parallel ranks; bad images are 400s naming
the part, and the server keeps serving."""

import base64
import io
from pathlib import Path

import openai
import pytest

import hfaccel
from tests.hf.vlm_models import image, llava_with_processor
from tests.helpers import Server


def data_url(picture, kind: str = "PNG") -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format=kind)
    return f"data:image/{kind.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def user(text: str, *urls: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                *({"type": "image_url", "image_url": {"url": url}} for url in urls),
                {"type": "text", "text": text},
            ],
        }
    ]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("llava")
    model, processor = llava_with_processor()
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path, model, processor


@pytest.fixture(scope="module")
def served(saved):
    path, model, processor = saved
    server = Server(path, "--allowed-media-domains", "images.example.com")
    yield server, model, processor
    server.stop()


def engine_text(model, processor, messages: list[dict]) -> str:
    """What the Engine answers to the same chat, its images opened from their URLs."""
    from PIL import Image

    opened = [
        {
            **m,
            "content": [
                {
                    "type": "image",
                    "image": Image.open(io.BytesIO(base64.b64decode(p["image_url"]["url"].split(",", 1)[1]))),
                }
                if p["type"] == "image_url"
                else p
                for p in m["content"]
            ],
        }
        for m in messages
    ]
    engine = hfaccel.Engine(model, processor, num_blocks=32)
    out = engine.generate([opened], hfaccel.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    return out.outputs[0].text


def test_chat_with_images_streamed_and_not(served):
    server, model, processor = served
    _answers_like_the_engine(server, model, processor)


@pytest.mark.slow
def test_chat_with_images_over_two_tensor_parallel_ranks(saved):
    """``--tensor-parallel-size 2``: the ranks load the model with its processor; rank 0 broadcasts each image
    prompt's prefill, and the replies are the single-process Engine's."""
    path, model, processor = saved
    server = Server(path, "--tensor-parallel-size", "2")
    try:
        _answers_like_the_engine(server, model, processor)
    finally:
        assert server.stop() == 0


@pytest.mark.slow
def test_a_prefill_that_fails_on_rank_0_alone_ends_the_tp_server(saved):
    """Rank 0's multimodal prefill runs out of memory there alone (tests/serve/one_rank_out_of_memory): the follower
    is left inside the forward's collectives, so rank 0 gets no outcome from it and its engine stops with
    TensorParallelError — the request gets a 503 naming it, the server drains and exits with status 1, and the
    supervisor stops the follower: no rank is left waiting for the other."""
    path, _, _ = saved
    sabotage = {"PYTHONPATH": str(Path(__file__).parent / "one_rank_out_of_memory"), "HFACCEL_TEST_OOM_RANK": "0"}
    server = Server(path, "--tensor-parallel-size", "2", env=sabotage)
    log = server.ended_by(
        lambda: server.client().chat.completions.create(
            model="tiny", messages=user("What is this?", data_url(image(40, 50))), max_tokens=4
        ),
        "TensorParallelError",
    )
    assert "tensor-parallel rank 0 of 2 failed" in log and "not every rank said it raised there too" in log, log[-3000:]


def _answers_like_the_engine(server: Server, model, processor) -> None:
    client = server.client()
    messages = user("What is in these?", data_url(image(40, 50)), data_url(image(30, 20, 1), "JPEG"))
    expected = engine_text(model, processor, messages)
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens > 2 * 16  # each image's placeholder expanded to its 16 tokens
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}, stream=True
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == expected
    assert server.wait_idle()["blocks_used"] == 0


def test_a_chats_next_turn_adding_an_image_reports_the_turn_before_as_cached(served):
    """A chat's next turn repeats the turn before (its image, a long question, the answer) and adds an image: the
    server takes the blocks of the turn before from the prefix cache — past its image, which starts at the prompt's
    third token — and says so in ``usage.prompt_tokens_details.cached_tokens``, streamed and not; the answer is the
    Engine's for the whole chat."""
    server, model, processor = served
    client = server.client()
    question = user(
        "What is this? Describe every detail of the picture: its colours, its shapes, and anything else in it.",
        data_url(image(40, 50, 5)),
    )
    first = client.chat.completions.create(model="tiny", messages=question, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    answer = {"role": "assistant", "content": [{"type": "text", "text": first.choices[0].message.content}]}
    chat = [*question, answer, *user("And this one?", data_url(image(30, 30, 6)))]
    expected = engine_text(model, processor, chat)
    cached = first.usage.prompt_tokens // 16 * 16  # the turn before's full blocks of 16 (its image ends at 18)
    assert cached >= 32
    reply = client.chat.completions.create(
        model="tiny", messages=chat, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens_details.cached_tokens >= cached
    stream = client.chat.completions.create(
        model="tiny",
        messages=chat,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == expected
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= cached


@pytest.mark.parametrize(
    "url,message",
    [
        ("data:image/png;base64,bm90IGFuIGltYWdl", "not an image that can be decoded"),
        ("data:image/png;base64,@@@", "base64"),
        ("data:image/png,raw", "data:<mime type>;base64"),
        ("ftp://images.example.com/a.png", r"data: URL or an http\(s\) URL"),
        ("https://elsewhere.example.org/a.png", "not among the domains"),
    ],
)
def test_bad_images_are_400s_and_the_server_keeps_serving(served, url, message):
    server, _, _ = served
    client = server.client()
    with pytest.raises(openai.BadRequestError, match=message) as caught:
        client.chat.completions.create(model="tiny", messages=user("What?", url), max_tokens=2)
    assert "messages" in str(caught.value)
    reply = client.chat.completions.create(
        model="tiny", messages=user("And this?", data_url(image(40, 50))), max_tokens=2
    )
    assert reply.choices[0].finish_reason == "length"


def test_too_many_images_are_a_400(served):
    server, _, _ = served
    with pytest.raises(openai.BadRequestError, match="at most 16 images"):
        server.client().chat.completions.create(
            model="tiny", messages=user("Many", *[data_url(image(8, 8))] * 17), max_tokens=2
        )
