from diloco.config import SyncConfig
from diloco.config_doc import OUT, field_docs, render


def test_every_config_field_is_documented():
    assert set(field_docs(SyncConfig)) == set(SyncConfig.__dataclass_fields__)


def test_config_reference_is_up_to_date():
    assert OUT.read_text() == render(), "docs/config.md is stale: run `python -m diloco.config_doc`"
