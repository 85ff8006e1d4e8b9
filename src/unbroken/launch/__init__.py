"""The agent: spawns and watches workers, holds the control store on node 0, restarts."""
