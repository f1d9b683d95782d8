{{/* Resource name prefix: the release name, plus the chart name unless it contains it. */}}
{{- define "proxyaudit.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "proxyaudit.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "proxyaudit.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "proxyaudit.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of a component: include with (list $ "aggregator"). */}}
{{- define "proxyaudit.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "proxyaudit.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "proxyaudit.aggregator" -}}{{ include "proxyaudit.fullname" . }}-aggregator{{- end -}}
{{- define "proxyaudit.collector" -}}{{ include "proxyaudit.fullname" . }}-collector{{- end -}}

{{/* The name in the aggregator's certificate; collectors verify it. */}}
{{- define "proxyaudit.serverName" -}}{{ include "proxyaudit.aggregator" . }}.{{ .Release.Namespace }}.svc{{- end -}}

{{- define "proxyaudit.tlsNames" -}}
{{- $agg := include "proxyaudit.aggregator" . -}}
{{- $ns := .Release.Namespace -}}
{{- join "," (list (include "proxyaudit.serverName" .) (printf "%s.%s.svc.cluster.local" $agg $ns) (printf "%s.%s" $agg $ns) $agg (printf "%s-headless.%s.svc" $agg $ns)) -}}
{{- end }}

{{- define "proxyaudit.tlsSecret" -}}
{{- .Values.tls.existingSecret | default (printf "%s-tls" (include "proxyaudit.aggregator" .)) -}}
{{- end -}}

{{/* Secret holding the Slack credential, "" when Slack is off. */}}
{{- define "proxyaudit.slackSecret" -}}
{{- if .Values.slack.existingSecret -}}
{{- .Values.slack.existingSecret -}}
{{- else if or .Values.slack.botToken .Values.slack.webhookURL -}}
{{- include "proxyaudit.aggregator" . }}-slack
{{- end -}}
{{- end -}}

{{/* "bot", "webhook" or "" */}}
{{- define "proxyaudit.slackMode" -}}
{{- if .Values.slack.channel -}}
{{- if not (or .Values.slack.botToken .Values.slack.existingSecret) -}}
{{- fail "slack.channel is set but there is no bot token: set slack.existingSecret (key slack.tokenKey) or slack.botToken" -}}
{{- end -}}
bot
{{- else if or .Values.slack.webhookURL (and .Values.slack.existingSecret .Values.slack.webhookKey) -}}
webhook
{{- else if or .Values.slack.botToken .Values.slack.existingSecret -}}
{{- fail "a Slack bot token needs slack.channel (the channel ID incidents open in); for a webhook set slack.webhookURL or slack.webhookKey" -}}
{{- end -}}
{{- end -}}

{{- define "proxyaudit.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}{{ with .Values.image.digest }}@{{ . }}{{ end }}
{{- end -}}

{{- define "proxyaudit.remediating" -}}
{{- if ne .Values.remediation.mode "dry-run" }}true{{ end -}}
{{- end -}}
