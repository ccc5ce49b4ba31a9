"""The storage seam: blobs, the metadata index, fill locks, freshness, eviction."""
