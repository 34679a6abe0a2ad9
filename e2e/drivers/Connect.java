// Connects with pgjdbc as docs/operations.md says: `java -cp postgresql.jar Connect.java VAR`
// opens DriverManager.getConnection(<the environment variable VAR>): the Secret's `jdbc-url`
// as JDBC_URL, or a secretTemplate's SPRING_DATASOURCE_URL with SPRING_DATASOURCE_USERNAME
// and SPRING_DATASOURCE_PASSWORD. Prints one line:
// `driver=pgjdbc <version> user=<login> ssl=<on|off>`.
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.ResultSet;
import java.util.Properties;

public class Connect {
    public static void main(String[] args) throws Exception {
        String variable = args.length > 0 ? args[0] : "JDBC_URL";
        String url = System.getenv(variable);
        if (url == null) {
            throw new IllegalArgumentException("no environment variable " + variable);
        }
        Properties props = new Properties();
        props.setProperty("connectTimeout", "10");
        String user = System.getenv("SPRING_DATASOURCE_USERNAME");
        if (variable.startsWith("SPRING_") && user != null) {
            props.setProperty("user", user);
            props.setProperty("password", System.getenv("SPRING_DATASOURCE_PASSWORD"));
        }
        try (Connection conn = DriverManager.getConnection(url, props);
             ResultSet rs = conn.createStatement().executeQuery(
                 "SELECT current_user, ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")) {
            rs.next();
            System.out.println("driver=pgjdbc " + conn.getMetaData().getDriverVersion()
                + " user=" + rs.getString(1) + " ssl=" + (rs.getBoolean(2) ? "on" : "off"));
        }
    }
}
