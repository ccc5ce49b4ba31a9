"""The test S3 server itself: a session makes a bucket per S3 test, and each must take
writes whatever the machine's free disk (CI once failed on a put to a new bucket: weed had
handed out every volume slot it derived from the free disk, one per bucket)."""

from __future__ import annotations

from tests.support.seaweedfs import VOLUME_SLOTS, S3Server


def test_a_new_bucket_takes_one_volume_slot_of_a_count_set_for_every_machine(
        s3_server: S3Server) -> None:
    total, free_before = s3_server.volume_slots()
    bucket = s3_server.new_bucket()
    s3_server.client().put_object(  # type: ignore[attr-defined]
        Bucket=bucket, Key="first", Body=b"a bucket's first write takes its volume")
    assert total == VOLUME_SLOTS
    assert free_before - s3_server.volume_slots()[1] == 1
