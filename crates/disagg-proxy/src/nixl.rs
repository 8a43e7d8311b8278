//! `disagg-proxy nixl-ports PLAN.toml`: the NIXL side-channel plan of a deployment, as a
//! table or JSON, or the reason it would fail (see `docs/nixl.md`).

use std::fmt::Write as _;
use std::path::PathBuf;

use clap::Args;
use disagg_nixl::{NodePlan, Plan};

use crate::BoxError;

/// Flags of `nixl-ports`.
#[derive(Debug, Args)]
pub(crate) struct NixlPortsArgs {
    /// The plan file (TOML: `scheme`, `ephemeral_ports`, `[[host]]`, `[[host.deployment]]`).
    #[arg(value_name = "PLAN.toml")]
    plan: PathBuf,
    /// Print the plan as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// Reads, checks and prints the plan; the error names the engines and port at fault.
pub(crate) async fn run(args: NixlPortsArgs) -> Result<(), BoxError> {
    // A regular file of at most 1 MiB: `/dev/zero` or a FIFO given by mistake is
    // refused, not read until memory runs out or waited on.
    let text = crate::files::read_text(&args.plan, crate::files::MAX_FILE_BYTES)
        .map_err(|e| format!("cannot read {}: {e}", args.plan.display()))?;
    let plan = Plan::from_toml(&text)?.plan()?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
    } else {
        print!("{}", table(&plan));
    }
    Ok(())
}

/// The plan as an aligned text table, then each engine's `--kv-transfer-config`.
fn table(plan: &NodePlan) -> String {
    let header = ["engine", "role", "host", "ports", "engine id", "env"];
    let rows: Vec<[String; 6]> = plan
        .engines
        .iter()
        .map(|e| {
            let ports = if e.listeners.len() > 1 {
                format!("{}-{}", e.port, e.last_port())
            } else {
                e.port.to_string()
            };
            let env = e
                .env
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(" ");
            [
                e.engine.clone(),
                e.role.to_string(),
                e.host.clone(),
                ports,
                e.engine_id.clone(),
                env,
            ]
        })
        .collect();
    let mut widths = header.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let mut out = format!("scheme: {}\n", plan.scheme.as_str());
    let mut line = |cells: &[&str]| {
        let mut l = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            if i + 1 == cells.len() {
                l.push_str(cell);
            } else {
                let _ = write!(l, "{cell:<w$}  ");
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(&header);
    for row in &rows {
        line(&row.each_ref().map(String::as_str));
    }
    out.push('\n');
    for e in &plan.engines {
        let _ = writeln!(
            out,
            "{} on {}: --kv-transfer-config '{}'",
            e.engine, e.host, e.kv_transfer_config
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shipped example plan is valid and prints the documented table.
    #[test]
    fn example_plan_table() {
        let text = include_str!("../../../examples/nixl-plan.toml");
        let plan = Plan::from_toml(text)
            .expect("example parses")
            .plan()
            .expect("example plans");
        let out = table(&plan);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "scheme: per-tp-worker");
        assert!(lines[1].starts_with("engine     role     host      ports        engine id"));
        assert!(lines[4].starts_with(
            "decode/0   decode   10.0.0.5  22000-22003  decode-10.0.0.5-22000   VLLM_NIXL_SIDE_CHANNEL_HOST=10.0.0.5 VLLM_NIXL_SIDE_CHANNEL_PORT=22000"
        ));
        assert!(lines[5].contains("VLLM_NIXL_SIDE_CHANNEL_HOST=10.0.1.6"));
        assert!(out.contains(
            r#"prefill/1 on 10.0.0.5: --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both","engine_id":"prefill-10.0.0.5-20002"}'"#
        ));
    }
}
