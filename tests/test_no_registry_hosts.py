"""The project names no package registry: Maven resolves from its default, pip from its own
configuration, apt from the machine's configured sources.

Every http(s) address in the tracked files must be one of a short list (loopback, the tests'
made-up S3 endpoint, Dagster's documentation, and the XML namespace and schema of a Maven POM,
which Maven never fetches); `.mvn/settings.xml` may only block repositories, and
`scripts/install.sh` may not configure an apt source.
"""

from __future__ import annotations

import re
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ADDRESS = re.compile(r"https?://([A-Za-z0-9.-]+)")
ALLOWED = {"127.0.0.1", "localhost", "s3.example.internal", "docs.dagster.io"}
# A POM's xmlns and xsi:schemaLocation: identifiers, not places Maven downloads from.
POM_NAMESPACES = {"maven.apache.org", "www.w3.org"}


def _tracked_text_files() -> list[Path]:
    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    files = []
    for name in filter(None, names):
        path = REPO / name
        if path.is_file() and b"\0" not in path.read_bytes()[:8192]:
            files.append(path)
    return files


def test_every_address_is_loopback_documentation_or_a_pom_namespace():
    found = []
    for path in _tracked_text_files():
        allowed = ALLOWED | (POM_NAMESPACES if path.name == "pom.xml" else set())
        for host in ADDRESS.findall(path.read_text(errors="replace")):
            if host not in allowed:
                found.append(f"{path.relative_to(REPO)}: {host}")
    assert found == []


def test_maven_settings_only_block_repositories():
    settings = ET.parse(REPO / ".mvn" / "settings.xml").getroot()
    mirrors = settings.findall("./mirrors/mirror")
    assert mirrors, "the repository Spark's parent POM adds must stay blocked"
    for mirror in mirrors:
        assert mirror.findtext("blocked") == "true", ET.tostring(mirror)
        assert "://" not in (mirror.findtext("url") or ""), ET.tostring(mirror)
    assert settings.find("./profiles") is None and settings.find("./servers") is None


def test_install_sh_uses_the_machines_apt_sources():
    script = (REPO / "scripts" / "install.sh").read_text()
    assert not re.search(r"^\s*deb(-src)?\s", script, re.M)
    assert "sourcelist" not in script.lower() and "sourceparts" not in script.lower()
