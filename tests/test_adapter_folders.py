"""An adapter loaded while the server runs (the admin socket's ADAPTER_ACTION, which POST /admin/adapters sends too)
is read only from the folders the operator chose: the model's ``adapter_dir``, else the folders of the model file
and of its declared adapters, with links and ``..`` resolved first. Before, an admin call loaded any file the
server's user could read."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import ServerProcess
from engines import adapters_for

from mpserve import Client
from mpserve.errors import BadRequest

pytestmark = pytest.mark.timeout(120)

OUTSIDE = "outside the folders adapters may be loaded from"


@pytest.fixture(scope="module")
def loras(tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], dict[str, str]]:
    """Adapters in the folder the model declares them from, and in another."""
    return (adapters_for(tiny_model_path, tmp_path_factory.mktemp("declared"), ("a0", "a1")),
            adapters_for(tiny_model_path, tmp_path_factory.mktemp("elsewhere"), ("b0",)))


def start(start_server: type[ServerProcess], declared: dict[str, str], *args: str) -> ServerProcess:
    return start_server("--model", "builtin:tiny", "--instances", "1", "--threads", "1", "--lora",
                        f"a0={declared['a0']}", *args).wait_ready()


def test_by_default_a_hot_load_is_read_from_the_folders_of_the_model_and_its_declared_adapters_only(
        start_server: type[ServerProcess], loras: tuple[dict[str, str], dict[str, str]], tmp_path: Path) -> None:
    declared, elsewhere = loras
    folder, other = Path(declared["a0"]).parent, Path(elsewhere["b0"]).parent
    link = folder / f"link-{tmp_path.name}.gguf"
    link.symlink_to(elsewhere["b0"])
    server = start(start_server, declared)
    with Client(server.admin) as admin:
        for path in (elsewhere["b0"], str(link), f"{folder}/../{other.name}/b0.gguf"):
            with pytest.raises(BadRequest, match=OUTSIDE):
                admin.adapter("load", "tiny", "b0", path)
        assert set(admin.adapter("load", "tiny", "a1", declared["a1"]).adapters) == {"a0", "a1"}


def test_with_adapter_dir_a_hot_load_is_read_from_that_folder_only(
        start_server: type[ServerProcess], loras: tuple[dict[str, str], dict[str, str]]) -> None:
    declared, elsewhere = loras
    server = start(start_server, declared, "--adapter-dir", str(Path(elsewhere["b0"]).parent))
    with Client(server.admin) as admin:
        with pytest.raises(BadRequest, match=f"{OUTSIDE} \\({Path(elsewhere['b0']).parent}\\)"):
            admin.adapter("load", "tiny", "a1", declared["a1"])
        assert set(admin.adapter("load", "tiny", "b0", elsewhere["b0"]).adapters) == {"a0", "b0"}
