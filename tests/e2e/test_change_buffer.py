"""`--change-buffer`: a syncer bounds the downlink changes it keeps for learners that lag (downlink.bound_changes)."""

from diloco import ServerOptions, SyncerThread, cli, for_mode


def test_the_syncer_bounds_its_changes_unless_told_not_to(tmp_path):
    cfg = for_mode("decoupled", 2, fragments=2, sync_every=4)
    for share, bound in ((ServerOptions.change_buffer_share, 0.05), (0.0, None)):
        syncer = SyncerThread(cfg, ServerOptions(listen="127.0.0.1:0", http=None, out=tmp_path / str(share),
                                                 change_buffer_share=share))
        try:
            assert syncer.service.core.change_buffer == bound
        finally:
            syncer.stop()


def test_a_negative_change_buffer_is_refused_in_one_line(capsys):
    assert cli.main(["syncer", "--change-buffer", "-0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--change-buffer must be a share of the model's size" in err[0], err


def test_diloco_syncer_defaults_to_the_servers_own_bounds():
    args = cli.build_parser().parse_args(["syncer"])
    assert (args.push_buffer, args.agreement_buffer, args.change_buffer) == (
        ServerOptions.push_buffer_share, ServerOptions.agreement_buffer_share, ServerOptions.change_buffer_share)
