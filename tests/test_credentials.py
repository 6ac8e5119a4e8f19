"""Credential files: the authority, identities, invitations and revocations, in Python and through the CLI."""

import json
import math
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from peer.credentials import (
    MIN_DAYS,
    check_peer_id,
    create_swarm,
    invite,
    load_authority,
    load_credentials,
    new_identity,
    peer_id_of_identity,
    revoke,
)
from swarm.config import SwarmConfig
from swarm.config_toml import load_config
from swarm.errors import ConfigError
from swarm.rpc.auth import AccessDenied, Certificate, CredentialError, RevocationList, decode_public_key

NOW = 1_700_000_000.0


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def private_swarm(tmp_path: Path) -> tuple[Path, SwarmConfig]:
    return tmp_path / "swarm", create_swarm("demo", tmp_path / "swarm", private=True)


def test_create_writes_config_and_a_secret_authority(private_swarm: tuple[Path, SwarmConfig], tmp_path: Path) -> None:
    root, cfg = private_swarm
    assert load_config(root / "swarm.toml") == cfg == SwarmConfig(name="demo", authority=cfg.authority)
    assert mode(root / "authority.key") == 0o600
    key = load_authority(root / "authority.key")
    assert (
        decode_public_key((root / "authority.pub").read_text()) == key.public_key() == decode_public_key(cfg.authority)
    )
    with pytest.raises(CredentialError, match="already exists"):
        create_swarm("demo", root, private=True)
    assert load_authority(root / "authority.key").private_bytes_raw() == key.private_bytes_raw(), "the key must survive"
    public = create_swarm("open", tmp_path / "open", private=False)
    assert sorted(p.name for p in (tmp_path / "open").iterdir()) == ["swarm.toml"] and public.name == "open"
    assert public == SwarmConfig(name="open") and not public.authority


def test_private_swarms_of_one_name_get_their_authoritys_id(
    private_swarm: tuple[Path, SwarmConfig], tmp_path: Path
) -> None:
    _, first = private_swarm
    second = create_swarm("demo", tmp_path / "again", private=True)
    public = create_swarm("demo", tmp_path / "public", private=False)
    assert len({first.swarm_id, second.swarm_id, public.swarm_id}) == 3 and first.authority != second.authority
    # pinned: a public swarm's id changes only when a config default does, never with the authority field
    assert public.swarm_id == "demo-7b66ffb8802e9811"
    with pytest.raises(ConfigError, match="authority.pub"):
        SwarmConfig(name="demo", authority="not a key")


def test_authority_readable_by_others_is_refused(private_swarm: tuple[Path, SwarmConfig]) -> None:
    root, _ = private_swarm
    (root / "authority.key").chmod(0o644)
    with pytest.raises(CredentialError, match="chmod 600"):
        load_authority(root / "authority.key")


def test_identity_is_created_once(tmp_path: Path) -> None:
    path = tmp_path / "ids" / "peer.id"
    peer_id = new_identity(path)
    assert peer_id_of_identity(path) == peer_id == check_peer_id(peer_id)
    assert mode(path) == 0o400
    with pytest.raises(CredentialError, match="already exists"):
        new_identity(path)
    with pytest.raises(CredentialError, match="not a libp2p peer id"):
        check_peer_id("not-a-peer-id")
    (tmp_path / "junk.id").write_bytes(b"junk")
    with pytest.raises(CredentialError, match="not a libp2p identity"):
        peer_id_of_identity(tmp_path / "junk.id")


def test_invite_then_load_credentials(private_swarm: tuple[Path, SwarmConfig], tmp_path: Path) -> None:
    root, cfg = private_swarm
    me, someone = new_identity(tmp_path / "me.id"), new_identity(tmp_path / "someone.id")
    cert = invite(root / "authority.key", cfg.swarm_id, me, days=2, out=tmp_path / "me.cert", clock=lambda: NOW)
    assert (cert.peer_id, cert.swarm_id, cert.expires_at - cert.issued_at) == (me, cfg.swarm_id, 2 * 86400)
    creds = load_credentials(tmp_path / "me.id", tmp_path / "me.cert", cfg.swarm_id, clock=lambda: NOW + 1)
    assert creds.verifier.check(me, creds.certificate_bytes()) == cert == Certificate.decode(creds.certificate_bytes())
    with pytest.raises(AccessDenied, match="issued to peer"):  # someone else's identity with my certificate
        load_credentials(tmp_path / "someone.id", tmp_path / "me.cert", cfg.swarm_id, clock=lambda: NOW + 1)
    with pytest.raises(AccessDenied, match="expired at"):
        load_credentials(tmp_path / "me.id", tmp_path / "me.cert", cfg.swarm_id, clock=lambda: NOW + 3 * 86400)
    with pytest.raises(AccessDenied, match="for swarm"):
        load_credentials(tmp_path / "me.id", tmp_path / "me.cert", "other-0123456789abcdef", clock=lambda: NOW + 1)
    for days in (0, 0.000001, -1, math.nan, math.inf, 1e9):  # 0.000001 days is 0.09 s: void before it is issued
        with pytest.raises(CredentialError, match=r"--days must be between 0\.00069 \(one minute\) and 36525"):
            invite(root / "authority.key", cfg.swarm_id, someone, days=days, out=tmp_path / "x.cert")
    assert not (tmp_path / "x.cert").exists()
    shortest = invite(root / "authority.key", cfg.swarm_id, someone, days=MIN_DAYS, out=tmp_path / "x.cert")
    assert shortest.expires_at - shortest.issued_at == 60


def test_revoke_appends_to_a_signed_list(private_swarm: tuple[Path, SwarmConfig], tmp_path: Path) -> None:
    root, cfg = private_swarm
    me, other = new_identity(tmp_path / "me.id"), new_identity(tmp_path / "other.id")
    invite(root / "authority.key", cfg.swarm_id, me, days=2, out=tmp_path / "me.cert", clock=lambda: NOW)
    listing = root / "revocations.json"
    revoke(root / "authority.key", cfg.swarm_id, me, revocations=listing, clock=lambda: NOW + 10)
    second = revoke(root / "authority.key", cfg.swarm_id, other, revocations=listing, clock=lambda: NOW + 20)
    authority = load_authority(root / "authority.key").public_key()
    assert RevocationList.verify(listing.read_bytes(), authority, cfg.swarm_id) == second
    assert (second.sequence, second.revoked) == (2, {me: int(NOW) + 10, other: int(NOW) + 20})
    with pytest.raises(AccessDenied, match="revoked"):
        load_credentials(
            tmp_path / "me.id", tmp_path / "me.cert", cfg.swarm_id, revocations=listing, clock=lambda: NOW + 30
        )

    forged = json.loads(listing.read_text())
    forged["revoked"] = {}  # someone un-revoking everyone
    listing.write_text(json.dumps(forged, sort_keys=True, separators=(",", ":")))
    with pytest.raises(CredentialError, match="revocations.json"):
        revoke(root / "authority.key", cfg.swarm_id, me, revocations=listing)
    with pytest.raises(CredentialError, match="revocations.json"):
        load_credentials(
            tmp_path / "me.id", tmp_path / "me.cert", cfg.swarm_id, revocations=listing, clock=lambda: NOW + 30
        )


def swarmloco(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "peer", "swarm", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(300)
def test_cli_create_identity_invite_revoke(tmp_path: Path) -> None:
    root = tmp_path / "demo"
    created = swarmloco("create", "--name", "demo", "--private", "--out", str(root))
    assert created.returncode == 0, created.stderr
    cfg = load_config(root / "swarm.toml")
    assert cfg.swarm_id in created.stdout and mode(root / "authority.key") == 0o600
    again = swarmloco("create", "--name", "demo", "--private", "--out", str(tmp_path / "again"))
    assert again.returncode == 0 and load_config(tmp_path / "again" / "swarm.toml").swarm_id in again.stdout
    assert cfg.swarm_id not in again.stdout, "two private swarms named demo share an id"

    identity = swarmloco("identity", "--out", str(tmp_path / "peer.id"))
    assert identity.returncode == 0, identity.stderr
    peer_id = identity.stdout.strip()
    assert peer_id == peer_id_of_identity(tmp_path / "peer.id")

    key, config = str(root / "authority.key"), str(root / "swarm.toml")
    invited = swarmloco(
        "invite",
        "--authority",
        key,
        "--config",
        config,
        "--peer-id",
        peer_id,
        "--days",
        "7",
        "-o",
        str(tmp_path / "peer.cert"),
    )
    assert invited.returncode == 0, invited.stderr
    creds = load_credentials(tmp_path / "peer.id", tmp_path / "peer.cert", cfg.swarm_id)
    cert = creds.verifier.check(peer_id, creds.certificate_bytes())
    assert cert.expires_at - cert.issued_at == 7 * 86400

    revoked = swarmloco("revoke", "--authority", key, "--config", config, "--peer-id", peer_id)
    assert revoked.returncode == 0, revoked.stderr
    with pytest.raises(AccessDenied, match="revoked"):
        load_credentials(
            tmp_path / "peer.id", tmp_path / "peer.cert", cfg.swarm_id, revocations=root / "revocations.json"
        )


def test_cli_errors_are_one_line(private_swarm: tuple[Path, SwarmConfig], tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from peer.cli import app

    root, _ = private_swarm
    key, config = str(root / "authority.key"), str(root / "swarm.toml")
    cases = {
        ("create", "--name", "demo", "--private", "--out", str(root)): "already exists",
        (
            "invite",
            "--authority",
            key,
            "--config",
            config,
            "--peer-id",
            "nope",
            "-o",
            str(tmp_path / "x.cert"),
        ): "not a libp2p peer id",
        (
            "invite",
            "--authority",
            str(tmp_path / "missing.key"),
            "--config",
            config,
            "--peer-id",
            "nope",
            "-o",
            "x",
        ): "does not exist",
        ("identity", "--out", str(root / "swarm.toml")): "not a libp2p identity file",
        (
            "invite",
            "--authority",
            key,
            "--config",
            config,
            "--peer-id",
            "nope",
            "--days",
            "0.000001",
            "-o",
            str(tmp_path / "x.cert"),
        ): "--days must be between 0.00069 (one minute) and 36525 (100 years), got 1e-06",
    }
    for args, says in cases.items():
        result = CliRunner().invoke(app, ["swarm", *args])
        assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (args, result.output)
        assert says in result.stderr, result.stderr
