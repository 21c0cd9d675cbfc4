"""`kvmesh models deploy` and `rollback`: a rollout's steps streamed from the mesh's control."""

from __future__ import annotations

import argparse
import sys

import grpc

from kvmesh.client import key_metadata
from shared import grpc_errors
from shared.pb.kvmesh.v1 import mesh_control_pb2, mesh_control_pb2_grpc
from shared.runtime.tls import sync_channel


def run_control_command(args: argparse.Namespace) -> int:
    with sync_channel(args.control) as channel:
        control = mesh_control_pb2_grpc.MeshControlStub(channel)
        if args.models_command == "deploy":
            request = mesh_control_pb2.DeployRequest(model=args.name, version=args.version)
            if args.canary is not None:
                request.canary_percent = args.canary
            events = control.Deploy(request, metadata=key_metadata())
        else:
            rollback = mesh_control_pb2.RollbackRequest(model=args.name)
            events = control.Rollback(rollback, metadata=key_metadata())
        try:
            for event in events:
                print(f"kvmesh: {event.message}", flush=True)
                if event.done:
                    return 0
        except grpc.RpcError as error:
            raise grpc_errors.from_rpc_error(error) from None
    print("kvmesh: the rollout ended without finishing", file=sys.stderr)
    return 1
