"""Admin API (gRPC, kvstore.admin.v1) and the `kvstore admin` command."""
