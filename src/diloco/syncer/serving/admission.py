"""Who may call the syncer, mixed into SyncerService: the run token, a learner's own credential (its token or its
client certificate), the credentials in force and their revocation, a learner id's form, a live id's takeover, and
the session secret of every later call. It uses the service's state (`core`, `token`, `credentials`,
`client_cert_ids`, `allow_takeover`, `_queues`, `wake`) and helpers (`_refuse`, `_core`)."""

from __future__ import annotations

import hmac
import logging

import grpc

from diloco.syncer.membership import Refused, check_learner_id
from diloco.syncer.ledger import NOBODY, LearnerRecord
from diloco.syncer.revocation import revoke, revoked_message
from diloco.wire.bounds import shown

log = logging.getLogger("diloco.syncer")


class Admission:
    async def _check_token(self, context, token: str) -> None:
        if self.token and not hmac.compare_digest(self.token.encode(), token.encode()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong or missing run token: pass the syncer's --token")

    async def _check_credential(self, context, learner_id: str, token: str) -> str | None:
        """The credential a Join or Init proves: the learner's own, named by its id (an id listed in --credentials
        needs its own token; the shared one cannot take it), or the shared run token (None: each id then counts as
        a party of its own)."""
        if self.client_cert_ids:
            names = context.auth_context().get("x509_common_name") or [b""]
            certified = names[0].decode(errors="replace")
            if certified != learner_id:
                await self._refuse(context, grpc.StatusCode.PERMISSION_DENIED, "wrong credential", (
                    f"learner id {shown(learner_id)} is not the one its client certificate names "
                    f"({shown(certified)}): a certificate proves one id; join under that one"))
            await self._check_token(context, token)
            return learner_id
        if self.credentials is not None and learner_id in self.credentials.digests:
            if self.credentials.check(learner_id, token):
                return learner_id
            await self._refuse(context, grpc.StatusCode.UNAUTHENTICATED, "wrong credential", (
                f"wrong or missing credential for learner {shown(learner_id)}: pass its own token with --token (the "
                f"one `diloco credentials new {learner_id}` printed)"))
        if self.credentials is not None and not self.token:
            await self._refuse(context, grpc.StatusCode.UNAUTHENTICATED, "wrong credential", (
                f"learner id {shown(learner_id)} has no credential on this syncer (none was given, or it was "
                f"revoked): ask its operator to add one (`diloco credentials new ID --file FILE`) and pass that token "
                f"with --token"))
        await self._check_token(context, token)
        return None

    # ---- credentials in force ------------------------------------------------------------------------------
    def vouched(self, record: LearnerRecord) -> bool:
        """Whether the credentials in force still stand behind `record`'s session (always, without a file)."""
        if self.credentials is None or self.client_cert_ids:
            return True
        return self.credentials.vouches(record.credential or record.id, record.proof)  # older ledgers: no name

    async def use_credentials(self, credentials, why: str) -> list[str]:
        """Put `credentials` (a new reading of --credentials) in force at once, and close the sessions they no
        longer vouch for; returns those learners' ids."""
        self.credentials = credentials
        log.info("credentials reloaded from %s (%s): %d learner ids", credentials.path, why, len(credentials.digests))
        return await self.close_revoked()

    async def close_revoked(self) -> list[str]:
        """Close the sessions the credentials in force do not vouch for (restored ones at start included): their
        update streams end, every later call is refused, and their contributions in open rounds are not merged."""
        revoked = await self._core(revoke, self.core, self.vouched)
        for learner_id in revoked:
            queue = self._queues.get(learner_id)
            if queue is not None:
                queue.put_nowait(None)  # its Subscribe ends, saying why
        if revoked:
            log.warning("revoked the credential of learner%s %s: %s closed", "s" if len(revoked) > 1 else "",
                        ", ".join(revoked), "their sessions are" if len(revoked) > 1 else "its session is")
            self.wake.set()  # rounds no longer wait for them
        return revoked

    async def _refuse_revoked(self, context, record: LearnerRecord | None) -> None:
        """Refuse a call of a session whose credential is no longer in force (checked on every call: a reload
        takes effect before the core has marked the record)."""
        if record is not None and (record.revoked or not self.vouched(record)):
            await self._refuse(context, grpc.StatusCode.PERMISSION_DENIED, "revoked credential",
                               revoked_message(record.id))

    async def _check_id(self, context, learner_id: str) -> None:
        try:
            check_learner_id(learner_id)
        except Refused:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid learner id", (
                f"invalid learner id {shown(learner_id)}: use 1-64 letters, digits, '.', '_' or '-', starting with a "
                f"letter or digit"))

    def _may_take_over(self, request) -> bool:
        """Whether a Join may supersede the live learner under its id: only with that learner's session secret,
        unless the operator allowed takeovers."""
        record = self.core.learners.get(request.learner_id)
        owner = record is not None and bool(request.session) and record.check_session(request.session)
        return owner or self.allow_takeover

    async def _authenticate(self, context, learner_id: str, session: str) -> None:
        """The learner's session secret is its credential for Push, Subscribe, Heartbeat and Leave (a read-only
        lookup). Unknown ids and wrong secrets get the same answer: it tells no one which ids exist."""
        record = self.core.learners.get(learner_id)
        expected = record if record is not None else NOBODY  # same work either way
        if not expected.check_session(session) or record is None:
            await self._refuse(context, grpc.StatusCode.UNAUTHENTICATED, "unknown learner or wrong session",
                               f"unknown learner or wrong session for learner {shown(learner_id)}: it left, re-joined "
                               f"elsewhere or never joined; join again")
        await self._refuse_revoked(context, record)
