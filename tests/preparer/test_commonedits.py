"""The node's common CDI edits from a fake driver root: exact libraries, mounts, hooks and device nodes;
the ld-cache, no-cache and container-driver-root layouts; the errors of an unusable root; the cache and
its refresh on a driver upgrade."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from services.preparer.gpu.commonedits import (
    CommonEdits,
    DriverFiles,
    build_driver_files,
    control_nodes,
    edits_of,
)
from services.preparer.host.cdi import READ_ONLY, CdiDevice, build_spec, gpu_device_nodes
from shared.driverroot import DriverRoot, DriverRootError
from tests.fakedriver import make_driver_root
from tests.preparer.cdischema import spec_errors
from tests.preparer.driverfiles import (
    EXPECTED_BINARIES,
    EXPECTED_FIRMWARE,
    EXPECTED_IPC,
    EXPECTED_LIBRARIES,
    LIB,
    V,
    expected_hook_args,
    upgrade,
)


@pytest.mark.parametrize(
    ("ld_cache", "lib_dir"),
    [(True, LIB), (False, LIB), (True, "/opt/nvidia/lib64")],
    ids=["ld-cache", "no-cache", "ld-cache-only-dir"],
)
def test_driver_files_are_the_compute_userspace(tmp_path: Path, ld_cache: bool, lib_dir: str) -> None:
    fake = make_driver_root(tmp_path / "driver", ld_cache=ld_cache, lib_dir=lib_dir)
    root = DriverRoot.of(str(fake.root))
    hook = f"{fake.root}/usr/bin/nvidia-cdi-hook"
    files = build_driver_files(root, hook, kernel="6.8.0-test")

    assert files.version == V
    assert files.libraries == sorted(p.replace(LIB, lib_dir) for p in EXPECTED_LIBRARIES)
    assert files.binaries == EXPECTED_BINARIES
    assert files.firmware == EXPECTED_FIRMWARE
    assert files.ipc == EXPECTED_IPC
    assert files.warnings == []
    mounted = [(m.container_path, m.host_path, m.options) for m in files.mounts]
    assert mounted == [
        (p, f"{fake.root}{p}", READ_ONLY)
        for p in (*files.libraries, *EXPECTED_BINARIES, *EXPECTED_FIRMWARE, *EXPECTED_IPC)
    ]
    assert READ_ONLY == ["ro", "nosuid", "nodev", "rbind", "rprivate"]
    assert [(h.hook_name, h.path) for h in files.hooks] == [("createContainer", hook)] * 4
    assert [h.args for h in files.hooks] == expected_hook_args(lib_dir)


def test_a_container_driver_root_reads_here_and_names_host_paths(tmp_path: Path) -> None:
    fake = make_driver_root(tmp_path / "mnt")
    root = DriverRoot.of("/run/nvidia/driver", str(fake.root))
    files = build_driver_files(root)
    assert files.libraries == EXPECTED_LIBRARIES
    assert {m.host_path for m in files.mounts} == {
        f"/run/nvidia/driver{p}" for p in (*EXPECTED_LIBRARIES, *EXPECTED_BINARIES, *EXPECTED_FIRMWARE, *EXPECTED_IPC)
    }
    assert all(not m.container_path.startswith(("/run/nvidia/driver", str(tmp_path))) for m in files.mounts)
    # the hook's default host path is outside the driver root: named as configured, not second-guessed
    assert {h.path for h in files.hooks} == {"/usr/bin/nvidia-cdi-hook"}
    nodes = control_nodes(root)
    assert [(n.path, n.host_path) for n in nodes] == [
        (p, f"/run/nvidia/driver{p}")
        for p in ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
    ]


def _char_device(path: Path) -> os.stat_result:
    """A char device node at `path`: made with mknod where allowed, else a link to /dev/null."""
    path.unlink()
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(195, 255))
    except PermissionError:
        path.symlink_to("/dev/null")
    return os.stat(path)


def test_control_nodes_exist_under_the_dev_root_with_major_minor_of_char_devices(tmp_path: Path) -> None:
    fake = make_driver_root(tmp_path / "driver")
    (fake.root / "dev" / "nvidia-modeset").unlink()
    st = _char_device(fake.root / "dev" / "nvidiactl")
    nodes = control_nodes(DriverRoot.of(str(fake.root)))
    ctl = {
        "path": "/dev/nvidiactl",
        "hostPath": f"{fake.root}/dev/nvidiactl",
        "type": "c",
        "major": os.major(st.st_rdev),
        "minor": os.minor(st.st_rdev),
        "fileMode": 0o666,
        "permissions": "rwm",
    }
    assert [n.to_json() for n in nodes] == [ctl] + [
        {"path": p, "hostPath": f"{fake.root}{p}", "fileMode": 0o666, "permissions": "rwm"}
        for p in ("/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
    ]  # nvidia-modeset is absent: skipped


def test_a_separate_dev_root(tmp_path: Path) -> None:
    fake = make_driver_root(tmp_path / "driver")
    (tmp_path / "host" / "dev").mkdir(parents=True)
    (tmp_path / "host" / "dev" / "nvidiactl").touch()
    nodes = control_nodes(DriverRoot.of(str(fake.root), "", str(tmp_path / "host")))
    assert [(n.path, n.host_path) for n in nodes] == [("/dev/nvidiactl", f"{tmp_path}/host/dev/nvidiactl")]


def test_a_claim_spec_with_the_common_edits_is_valid(tmp_path: Path) -> None:
    fake = make_driver_root(tmp_path / "driver")
    root = DriverRoot.of(str(fake.root))
    edits = edits_of(build_driver_files(root, f"{fake.root}/usr/bin/nvidia-cdi-hook"), control_nodes(root))
    spec = build_spec("3f1c-uid", [CdiDevice("gpu-0", gpu_device_nodes(0, root.dev_host))], edits)
    assert spec_errors(spec) == []
    common = spec["containerEdits"]
    assert common["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert len(common["mounts"]) == len(EXPECTED_LIBRARIES) + 7 + 2 + 2 and len(common["hooks"]) == 4


# ------------------------------------------------------------------------------------ unusable roots
def test_a_root_without_nvml_is_an_error_naming_it(tmp_path: Path) -> None:
    fake = make_driver_root(tmp_path / "driver", nvml=False)
    with pytest.raises(DriverRootError, match=f"no libnvidia-ml.so.1 under driver root {fake.root}"):
        build_driver_files(DriverRoot.of(str(fake.root)))


def test_mixed_driver_versions_are_an_error_naming_the_root(tmp_path: Path) -> None:
    fake = make_driver_root(tmp_path / "driver")
    upgrade(fake.root, LIB, "560.28.03", cuda=False)  # NVML moved on, libcuda.so.1 did not
    with pytest.raises(
        DriverRootError,
        match=f"driver root {fake.root} mixes driver versions: "
        f"libnvidia-ml.so.1 is 560.28.03 but libcuda.so.1 is libcuda.so.{V}",
    ):
        build_driver_files(DriverRoot.of(str(fake.root)))


def test_a_missing_hook_binary_leaves_the_hooks_out_with_a_warning(tmp_path: Path) -> None:
    fake = make_driver_root(tmp_path / "driver", binaries=("nvidia-smi",))
    files = build_driver_files(DriverRoot.of(str(fake.root)), f"{fake.root}/usr/bin/nvidia-cdi-hook")
    assert files.hooks == [] and files.hook_path == ""
    assert len(files.libraries) == len(EXPECTED_LIBRARIES)  # the files are still mounted
    [warning] = files.warnings
    assert f"nvidia-cdi-hook is not at {fake.root}/usr/bin/nvidia-cdi-hook" in warning
    assert "install the NVIDIA container toolkit or set --cdi-hook-path" in warning


def test_a_hook_elsewhere_under_the_root_is_found(tmp_path: Path) -> None:
    fake = make_driver_root(tmp_path / "driver")
    (fake.root / "usr" / "local" / "nvidia" / "toolkit").mkdir(parents=True)
    (fake.root / "usr" / "bin" / "nvidia-cdi-hook").rename(fake.root / "usr/local/nvidia/toolkit/nvidia-cdi-hook")
    files = build_driver_files(DriverRoot.of(str(fake.root)), f"{fake.root}/usr/bin/nvidia-cdi-hook")
    assert {h.path for h in files.hooks} == {f"{fake.root}/usr/local/nvidia/toolkit/nvidia-cdi-hook"}
    assert "using" in files.warnings[0]


# ------------------------------------------------------------------------------------ the cache
async def test_edits_are_cached_and_rebuilt_when_the_driver_changes(tmp_path: Path) -> None:
    fake = make_driver_root(tmp_path / "driver")
    common = CommonEdits(
        driver_root=str(fake.root), cdi_hook_path=f"{fake.root}/usr/bin/nvidia-cdi-hook", check_interval=3600
    )
    await common.start()
    first = await common.get()
    assert {m.container_path for m in first.mounts} >= set(EXPECTED_LIBRARIES)

    upgrade(fake.root, LIB, "560.28.03")
    again = await common.get()  # within the check interval: served from memory, no look at the files
    assert again == first
    assert await common.refresh() is True  # the NVML link moved: rebuilt
    upgraded = await common.get()
    assert f"{LIB}/libnvidia-ml.so.560.28.03" in {m.container_path for m in upgraded.mounts}
    assert ["nvidia-cdi-hook", "enable-cuda-compat", "--host-driver-version=560.28.03"] in [
        h.args for h in upgraded.hooks
    ]
    assert await common.refresh() is False  # nothing changed since


async def test_a_due_check_on_get_notices_an_upgrade(tmp_path: Path) -> None:
    fake = make_driver_root(tmp_path / "driver")
    common = CommonEdits(driver_root=str(fake.root), check_interval=0)
    await common.start()
    upgrade(fake.root, LIB, "560.28.03")
    edits = await common.get()
    assert common.files.version == "560.28.03"
    assert f"{LIB}/libcuda.so.560.28.03" in {m.container_path for m in edits.mounts}


async def test_an_explicit_root_without_a_driver_fails_at_start(tmp_path: Path) -> None:
    fake = make_driver_root(tmp_path / "driver", nvml=False)
    with pytest.raises(DriverRootError, match=str(fake.root)):
        await CommonEdits(driver_root=str(fake.root)).start()


async def test_no_driver_and_no_root_given_degrades_to_device_nodes_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "empty").mkdir()  # "/" as this container sees it: no driver there
    (tmp_path / "sim" / "dev").mkdir(parents=True)
    (tmp_path / "sim" / "dev" / "nvidiactl").touch()
    common = CommonEdits(container_driver_root=str(tmp_path / "empty"), dev_root=str(tmp_path / "sim"))
    with caplog.at_level(logging.WARNING):
        await common.start()
        edits = await common.get()
        await common.get()
    assert common.files == DriverFiles()
    assert (edits.mounts, edits.hooks, edits.env) == ([], [], ["NVIDIA_VISIBLE_DEVICES=void"])
    assert [(n.path, n.host_path) for n in edits.nodes] == [("/dev/nvidiactl", f"{tmp_path}/sim/dev/nvidiactl")]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "containers get no driver libraries" in warnings[0]


async def test_a_driver_installed_after_start_is_picked_up(tmp_path: Path) -> None:
    (tmp_path / "mnt").mkdir()
    common = CommonEdits(container_driver_root=str(tmp_path / "mnt"), check_interval=0)
    await common.start()
    assert common.files.version == ""
    make_driver_root(tmp_path / "mnt")  # the GPU operator's driver container finished installing
    edits = await common.get()
    assert common.files.version == V
    assert {m.host_path for m in edits.mounts} >= {f"{p}" for p in EXPECTED_LIBRARIES}  # host root is /


def test_missing_optional_files_are_skipped_with_one_debug_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake = make_driver_root(
        tmp_path / "driver", binaries=("nvidia-smi", "nvidia-cdi-hook"), firmware=False, sockets=False
    )
    with caplog.at_level(logging.DEBUG, logger="services.preparer.gpu.commonedits"):
        files = build_driver_files(DriverRoot.of(str(fake.root)), f"{fake.root}/usr/bin/nvidia-cdi-hook")
    assert (files.binaries, files.firmware, files.ipc) == (["/usr/bin/nvidia-smi"], [], [])
    assert files.warnings == [] and len(files.hooks) == 4
    [line] = [r for r in caplog.records if r.name == "services.preparer.gpu.commonedits"]
    assert line.levelno == logging.DEBUG and line.getMessage() == "optional driver files absent; skipped"
    assert "nvidia-imex" in str(line.structured_fields["missing"])  # type: ignore[attr-defined]
