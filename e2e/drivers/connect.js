// Connects with node-postgres as docs/operations.md says:
// `node connect.js uri [VAR]` gives the Secret's `uri` (or VAR, e.g. a secretTemplate's
// DATABASE_URL) as `connectionString`, nothing else. Prints one line:
// `driver=node-postgres <version> user=<login> ssl=<on|off>`.
const { Client } = require("pg");

async function main() {
  const variable = process.argv[3] || "uri";
  const client = new Client({
    connectionString: process.env[variable],
    connectionTimeoutMillis: 10000,
  });
  await client.connect();
  try {
    const res = await client.query(
      "SELECT current_user AS user, ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()"
    );
    const version = require("pg/package.json").version;
    const row = res.rows[0];
    console.log(`driver=node-postgres ${version} user=${row.user} ssl=${row.ssl ? "on" : "off"}`);
  } finally {
    await client.end();
  }
}

main().catch((err) => {
  console.error(`node-postgres: ${err.message}`);
  process.exit(1);
});
